"""DeepSeek-V3 (671B total / 37B activated): 61 MLA layers, the first 3 with a dense FFN.

    jaxmoe info --config configs/deepseek_v3.py

The shape of the public checkpoint; ``jaxmoe convert hf`` reads the same fields from its
config.json (model_type ``deepseek_v3``).
"""

import ml_collections


def model(layer_kind="mla"):
    return dict(
        vocab_size=129280,
        d_model=7168,
        num_layers=61,
        layer_kinds=(layer_kind,) * 61,
        norm_eps=1e-6,
        max_context=163840,
        dtype="bfloat16",
        rope=dict(
            theta=10000.0,
            type="yarn",
            factor=40.0,
            original_max_position=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        mla=dict(
            num_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=dict(
            num_experts=256,
            experts_per_token=8,
            num_shared_experts=1,
            expert_ffw_dim=2048,
            dense_ffw_dim=18432,
            num_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense=3,
        ),
    )


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "deepseek_v3"
    c.model = model()
    c.mesh = dict(data=1, fsdp=8, expert=32, context=1, tensor=1)
    return c
