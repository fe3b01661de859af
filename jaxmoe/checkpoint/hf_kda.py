"""HF ``KimiLinearDeltaAttention`` tensors (torch layout) -> a jaxmoe :class:`KDA` module."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxmoe.attention.kda import KDA
from jaxmoe.checkpoint.hf_common import assign, linear_heads_out, linear_in_out, take
from jaxmoe.errors import CheckpointError


def load_kda(module: KDA, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """Fills ``module`` from the tensors under ``prefix`` (e.g. ``'model.layers.0.self_attn.'``).

    Reads the layout ``save_pretrained`` writes (that of the released Kimi Linear checkpoints;
    transformers renames it on load): torch ``[out, in]`` weights ``q_proj``, ``k_proj``,
    ``v_proj``, depthwise ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (``[N*H, 1, K]`` each),
    ``f_a_proj``, ``f_b_proj``, ``dt_bias`` ``[N*H]``, ``A_log`` ``[1, 1, N, 1]``, ``b_proj``,
    ``g_a_proj``, ``g_b_proj``, ``o_norm.weight``, ``o_proj``.
    """
    n, h, kw = module.num_heads, module.head_dim, module.conv_kernel

    def weight(name: str) -> tuple[str, np.ndarray]:
        key = f"{prefix}{name}"
        return key, take(tensors, key)

    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        key, w = weight(f"{theirs}.weight")
        assign(getattr(module, ours), linear_in_out(w, (n, h)), key)

    for stream in "qkv":
        key, conv = weight(f"{stream}_conv1d.weight")
        if conv.shape != (n * h, 1, kw):
            raise CheckpointError(f"tensor {key!r} has shape {conv.shape}, the model expects {(n * h, 1, kw)}")
        assign(getattr(module, f"{stream}_conv"), conv[:, 0].reshape(n, h, kw).transpose(2, 0, 1), key)

    key, w = weight("f_a_proj.weight")
    assign(module.f_a, w.T, key)  # [H, D] -> [D, H]
    key, w = weight("f_b_proj.weight")
    assign(module.f_b, linear_in_out(w, (n, h)), key)
    key, w = weight("dt_bias")
    if w.size != n * h:
        raise CheckpointError(f"tensor {key!r} has shape {w.shape}, the model expects {(n * h,)}")
    assign(module.dt_bias, w.reshape(n, h), key)  # [N*H] head-major -> [N, H]
    key, w = weight("A_log")
    if w.size != n:
        raise CheckpointError(f"tensor {key!r} has shape {w.shape}, the model expects {(1, 1, n, 1)}")
    assign(module.A_log, w.reshape(n), key)  # [1, 1, N, 1] -> [N]

    key, w = weight("b_proj.weight")
    assign(module.b, w.T, key)  # [N, D] -> [D, N]
    key, w = weight("g_a_proj.weight")
    assign(module.g_a, w.T, key)  # [H, D] -> [D, H]
    key, w = weight("g_b_proj.weight")
    assign(module.g_b, linear_in_out(w, (n, h)), key)
    key, w = weight("o_norm.weight")
    assign(module.o_norm, w, key)
    key, w = weight("o_proj.weight")
    assign(module.o, linear_heads_out(w, (n, h)), key)
