"""Kimi Linear 48B-A3B: 20 KDA layers and 7 NoPE MLA layers (1-indexed 4, 8, ..., 24, 27).

jaxmoe info --config configs/kimi_linear.py
"""

import ml_collections

FULL_ATTENTION_LAYERS = (4, 8, 12, 16, 20, 24, 27)  # 1-indexed, as in the checkpoint's config


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "kimi_linear"
    c.model = dict(
        vocab_size=163840,
        d_model=2304,
        num_layers=27,
        layer_kinds=tuple("mla" if i + 1 in FULL_ATTENTION_LAYERS else "kda" for i in range(27)),
        norm_eps=1e-5,
        max_context=1048576,
        dtype="bfloat16",
        mla=dict(
            num_heads=32,
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            use_rope=False,
        ),
        kda=dict(num_heads=32, head_dim=128, conv_kernel=4, chunk_size=64),
        moe=dict(
            num_experts=256,
            experts_per_token=8,
            num_shared_experts=1,
            expert_ffw_dim=1024,
            dense_ffw_dim=9216,
            num_groups=1,
            topk_groups=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            first_k_dense=1,
        ),
    )
    c.mesh = dict(data=1, fsdp=8, expert=8, context=1, tensor=1)
    return c
