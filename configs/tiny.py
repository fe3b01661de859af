"""Tiny hybrid model: every attention kind (mla, dsa, kda) and the MoE, runs in seconds on CPU.

    jaxmoe info --config configs/tiny.py

Mesh: data 2 x fsdp 2 x tensor 2 over XLA's 8 fake CPU devices.
"""

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "tiny"
    c.model = dict(
        vocab_size=512,
        d_model=64,
        num_layers=4,
        layer_kinds=("mla", "kda", "dsa", "kda"),
        norm_eps=1e-6,
        max_context=4096,
        rope=dict(theta=10000.0, type="default"),
        mla=dict(
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        # 8 indexer heads: with fewer, many keys score exactly 0 (every ReLU off) and top-k ties at
        # the boundary make the selected set depend on how the scan is blocked.
        indexer=dict(num_heads=8, head_dim=16, topk=32),
        kda=dict(num_heads=4, head_dim=16, conv_kernel=4, chunk_size=16),
        moe=dict(
            num_experts=8,
            experts_per_token=2,
            num_shared_experts=1,
            expert_ffw_dim=32,
            dense_ffw_dim=128,
            num_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense=1,
        ),
    )
    c.mesh = dict(data=2, fsdp=2, expert=1, context=1, tensor=2)
    return c
