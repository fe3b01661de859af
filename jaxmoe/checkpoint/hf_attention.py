"""HF (torch-layout) attention weights -> jaxmoe MLA / DSA modules.

Keys follow HF ``DeepseekV3Attention``, ``DeepseekV32Attention`` and ``KimiLinearAttention``
under a prefix such as ``"model.layers.3.self_attn."``. torch ``Linear`` weights are ``[out, in]``;
ours are input-dims first with heads split out. HF's interleaved RoPE reads the rope slice in the
stored order and so does ours, so no permutation of rope rows is needed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxmoe.attention.dsa import DSA
from jaxmoe.attention.mla import MLA
from jaxmoe.checkpoint.hf_common import assign, linear_heads_out, linear_in_out, take
from jaxmoe.errors import CheckpointError

# Projections that HF gives a bias when ``attention_bias`` is set; jaxmoe has none.
_BIAS_FREE = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj")


def _load(variable, tensors: Mapping[str, np.ndarray], key: str, convert=None) -> None:
    value = take(tensors, key)
    if convert is not None:
        try:
            value = convert(value)
        except ValueError as e:
            raise CheckpointError(f"tensor {key!r} has shape {value.shape}, which does not fit: {e}") from e
    assign(variable, value, key)


def load_mla(module: MLA, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """Copies HF MLA weights ``{prefix}q_a_proj.weight``, ... into ``module`` in place.

    Raises:
        CheckpointError: naming a missing key, a tensor of the wrong shape, or a bias that
            jaxmoe's bias-free projections cannot hold.
    """
    m = module.cfg.mla
    N, qk, Hn, Hv = m.num_heads, m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim
    for name in _BIAS_FREE:
        if f"{prefix}{name}.bias" in tensors:
            raise CheckpointError(f"tensor {prefix}{name}.bias: attention biases are not supported")
    if m.q_lora_rank > 0:
        Q = m.q_lora_rank
        _load(module.q_a, tensors, f"{prefix}q_a_proj.weight", lambda w: linear_in_out(w, (Q,)))
        _load(module.q_a_norm.weight, tensors, f"{prefix}q_a_layernorm.weight")
        _load(module.q_b, tensors, f"{prefix}q_b_proj.weight", lambda w: linear_in_out(w, (N, qk)))
    else:
        _load(module.q, tensors, f"{prefix}q_proj.weight", lambda w: linear_in_out(w, (N, qk)))
    C_R = m.kv_lora_rank + m.qk_rope_head_dim
    _load(module.kv_a, tensors, f"{prefix}kv_a_proj_with_mqa.weight", lambda w: linear_in_out(w, (C_R,)))
    _load(module.kv_a_norm.weight, tensors, f"{prefix}kv_a_layernorm.weight")
    _load(module.kv_b, tensors, f"{prefix}kv_b_proj.weight", lambda w: linear_in_out(w, (N, Hn + Hv)))
    _load(module.o, tensors, f"{prefix}o_proj.weight", lambda w: linear_heads_out(w, (N, Hv)))


def load_dsa(module: DSA, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """:func:`load_mla` plus the indexer: ``{prefix}indexer.wq_b.weight``, ``.wk``, ``.k_norm``,
    ``.weights_proj``."""
    load_mla(module, tensors, prefix)
    ix, cfg = module.indexer, module.cfg.indexer
    p = f"{prefix}indexer."
    _load(ix.wq_b, tensors, f"{p}wq_b.weight", lambda w: linear_in_out(w, (cfg.num_heads, cfg.head_dim)))
    _load(ix.wk, tensors, f"{p}wk.weight", lambda w: linear_in_out(w, (cfg.head_dim,)))
    _load(ix.k_norm.weight, tensors, f"{p}k_norm.weight")
    _load(ix.k_norm.bias, tensors, f"{p}k_norm.bias")
    _load(ix.weights_proj, tensors, f"{p}weights_proj.weight", lambda w: linear_in_out(w, (cfg.num_heads,)))
