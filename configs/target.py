"""The target model: ~2.8T total / ~104B activated parameters, 1,048,576-token context.

    jaxmoe info --config configs/target.py

96 layers in the Kimi-Linear rhythm (three KDA layers, then one full-attention layer), with 24
DSA layers as the full-attention layers and three of the KDA slots (layers 0, 32, 64) turned into
dense-attention MLA: 3 mla + 24 dsa + 69 kda. Dimensions follow the public DeepSeek-V3 / Kimi-K2
families: d_model 7168, MLA with 64 heads, q latent 1536, KV latent 512 + 64-d RoPE key
(128 nope + 64 rope per q/k head, 128 per v head), a 64-head x 128-d lightning indexer keeping the
top 2,048 tokens, KDA with 64 heads x 128, and a DeepSeek MoE of 640 routed experts (ffw 2112, 8
groups of 80, 4 kept) with 16 routed experts per token plus a shared expert three experts wide
(DeepSeek's n_shared_experts=3), the first layer dense (ffw 18432). YaRN (factor 32
over a 32K original window) stretches RoPE to 1M tokens.

Mesh and training step: one v5p-4096 slice (2,048 chips, topology 8x16x16) as fsdp 128 x expert 16
(40 routed experts a chip), one 4,096-token sequence a chip, capacity dispatch, remat and the
layer scan. Compiled for that slice from a CPU host it needs 77.2 GB of a chip's 95 GB
(docs/tpu.md, "Compiled for the slice"):

    jaxmoe compile --config configs/target.py --topology v5p:8x16x16
"""

import ml_collections

N_LAYERS = 96
MLA_LAYERS = (0, 32, 64)


def _layer_kinds():
    kinds = []
    for i in range(N_LAYERS):
        if i % 4 == 3:
            kinds.append("dsa")
        elif i in MLA_LAYERS:
            kinds.append("mla")
        else:
            kinds.append("kda")
    return tuple(kinds)


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "target"
    c.model = dict(
        vocab_size=163840,
        d_model=7168,
        num_layers=N_LAYERS,
        layer_kinds=_layer_kinds(),
        norm_eps=1e-6,
        max_context=1048576,
        dtype="bfloat16",
        param_dtype="float32",
        rope=dict(
            theta=50000.0,
            type="yarn",
            factor=32.0,
            original_max_position=32768,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        mla=dict(
            num_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        indexer=dict(num_heads=64, head_dim=128, topk=2048),
        kda=dict(num_heads=64, head_dim=128, conv_kernel=4, chunk_size=64),
        moe=dict(
            num_experts=640,
            experts_per_token=16,
            num_shared_experts=3,
            expert_ffw_dim=2112,
            dense_ffw_dim=18432,
            num_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense=1,
            dispatch="capacity",  # expert-parallel with fixed buffers: "dense" holds every expert on every chip
        ),
    )
    c.mesh = dict(data=1, fsdp=128, expert=16, context=1, tensor=1)
    c.batch_size = 2048  # one sequence a chip
    c.seq_len = 4096
    c.remat = True
    c.scan_layers = True
    return c
