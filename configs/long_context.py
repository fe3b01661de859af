"""Long-context variant of the tiny model: ``dsa`` and ``kda`` layers in the target's proportion
(about 1:3, no ``mla``), a 1,048,576-token context, the sequence split over 8 ``context`` shards.

    python benchmarks/long_context.py --tokens 1048576

Dims are the tiny model's; the indexer keeps the target's top-2,048 with two 16-wide heads (its
score costs ``T^2 / 2`` dot products of ``2 x 16``: the term that dominates a 1M-token prefill).
"""

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "long_context"
    c.model = dict(
        vocab_size=512,
        d_model=64,
        num_layers=4,
        layer_kinds=("kda", "kda", "kda", "dsa"),
        norm_eps=1e-6,
        max_context=1048576,
        rope=dict(theta=10000.0, type="default"),
        mla=dict(
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        indexer=dict(num_heads=2, head_dim=16, topk=2048),
        kda=dict(num_heads=4, head_dim=16, conv_kernel=4, chunk_size=64),
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
    c.mesh = dict(data=1, fsdp=1, expert=1, context=8, tensor=1)
    return c
