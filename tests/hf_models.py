"""Tiny HF transformers models of the three importable families, with random weights everywhere.

Shared by the logit-parity tests (tests/checkpoint/test_hf_import.py) and the decode-parity
tests (tests/inference/test_hf_generate.py).
"""

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=44,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=20,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    routed_scaling_factor=2.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **COMMON,
            num_hidden_layers=3,
            q_lora_rank=28,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            max_position_embeddings=128,
            rope_parameters=YARN,
        )
    )


def deepseek_v32():
    return transformers.DeepseekV32ForCausalLM(
        transformers.DeepseekV32Config(
            **COMMON,
            num_hidden_layers=3,
            q_lora_rank=28,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            index_topk=16,
            index_head_dim=16,
            # 8 indexer heads: with few heads, many keys score exactly 0 (every ReLU off) and
            # top-k ties at the boundary make the selected set implementation-defined.
            index_n_heads=8,
            max_position_embeddings=128,
        )
    )


def kimi_linear():
    common = {k: v for k, v in COMMON.items() if k != "routed_scaling_factor"}
    return transformers.KimiLinearForCausalLM(
        transformers.KimiLinearConfig(
            **common,
            num_hidden_layers=4,
            q_lora_rank=None,
            num_experts=8,
            num_experts_per_token=3,
            num_expert_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            linear_attn_config={
                "head_dim": 8,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 2, 4],
                "full_attn_layers": [3],
            },
        )
    )


FAMILIES = {"deepseek_v3": deepseek_v3, "deepseek_v32": deepseek_v32, "kimi_linear": kimi_linear}


def randomize(model, seed):
    """Random weights everywhere, not just where HF's init puts them: norms, biases, gates."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.dtype.is_floating_point or "inv_freq" in name:
                continue
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "A_log" in name:
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif "dt_bias" in name:
                p.copy_(torch.empty(p.shape).uniform_(-4.0, -1.0, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.eval()


def random_model(family: str, seed: int = 1):
    """The family's tiny model (eager attention, eval mode) with :func:`randomize`'d weights."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.config._attn_implementation = "eager"
    randomize(model, seed=seed)
    return model
