"""Streaming checkpoint conversion: HF folder -> jaxmoe (float or MXFP4), float <-> MXFP4.

Shape letters: E experts, D model dim, F expert ffw dim, G = contracting dim / 32.

Every conversion goes tensor by tensor: one output array is built, quantized or dequantized in
row chunks of at most :data:`CHUNK_ELEMENTS` (so the quantizer's temporaries stay small), written
(:class:`jaxmoe.checkpoint.io.ArrayTreeWriter`) and dropped before the next. Peak host memory is
about twice the largest float tensor (the HF importer stacks routed experts ``[E, in, out]`` from
per-expert tensors, then hands the stack over as a JAX array) plus a fixed ~1 GB (JAX, the
pending write group, chunk temporaries), with glibc's mmap threshold fixed so that freed tensors
go back to the OS (``MALLOC_MMAP_THRESHOLD_=1048576``, set by ``launch/env.sh``: library code does
not tune malloc). ``benchmarks/convert_memory.py`` measures it.

MXFP4 weights are the routed experts (:data:`jaxmoe.quant.ROUTED_EXPERTS`), packed along their
contracting axis exactly as :func:`jaxmoe.quant.quantize_state` packs them (see
:mod:`jaxmoe.quant.qarray` for the layout). HF tensors that are already MXFP4, stored
gpt-oss-style as ``<name>_blocks`` uint8 ``[out, in/32, 16]`` and ``<name>_scales`` uint8
``[out, in/32]`` next to where ``<name>`` (e.g. ``...experts.3.gate_proj.weight``; the form
without ``.weight`` is accepted too) would be, are stacked and passed through unchanged when the
output is MXFP4, and dequantized (exactly) otherwise.

An HF conversion also copies the source's tokenizer files (:data:`jaxmoe.chat.tokenizer.TOKENIZER_FILES`
that exist) into the new checkpoint, so ``jaxmoe generate`` and the server find the tokenizer there,
and keeps the source's ``eos_token_id`` (``generation_config.json``'s, else ``config.json``'s, written
as a ``generation_config.json``) for :meth:`jaxmoe.chat.tokenizer.Tokenizer.load` to read.
"""

from __future__ import annotations

import json
import pathlib
import re
import types
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxmoe.chat.tokenizer import GENERATION_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, copy_tokenizer_files
from jaxmoe.checkpoint.io import CheckpointReader, checkpoint_writer, config_to_dict
from jaxmoe.checkpoint.safetensors_folder import SafetensorsFolder
from jaxmoe.config import Config, from_config_dict
from jaxmoe.errors import CheckpointError

CHUNK_ELEMENTS = 1 << 23  # 32 MB of float32 per quantizer call
QUANT_FORMATS = ("mxfp4",)


# --------------------------------------------------------------------------------------------
# Chunked MXFP4 on host arrays


def _row_chunks(moved_shape: tuple[int, ...]) -> Iterator[tuple]:
    """Index tuples into ``[*lead, R, N]`` covering it in ``[rows, N]`` pieces of <= CHUNK_ELEMENTS."""
    if len(moved_shape) == 1:
        yield ()
        return
    *lead, rows, n = moved_shape
    step = max(1, CHUNK_ELEMENTS // max(n, 1))
    for idx in np.ndindex(*lead):
        for r0 in range(0, rows, step):
            yield (*idx, slice(r0, min(r0 + step, rows)))


def quantize_array(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4-packs ``w`` along ``axis`` in chunks; equals :func:`jaxmoe.quant.quantize_weight` bit for bit.

    Args:
        w: float array of logical shape ``S`` (e.g. ``w_gate [E, D, F]``), ``S[axis]`` a multiple of 32.
        axis: the contracting axis.

    Returns:
        ``(blocks, scales)`` uint8 ``[*S without S[axis], S[axis]/32, 16]`` and ``[..., S[axis]/32]``.
    """
    from jaxmoe.quant import mxfp4  # noqa: PLC0415

    moved = np.moveaxis(np.asarray(w), axis, -1)  # a view: [*rest, N]
    b_shape, s_shape = mxfp4.packed_shapes(moved.shape)
    blocks, scales = np.empty(b_shape, np.uint8), np.empty(s_shape, np.uint8)
    for idx in _row_chunks(moved.shape):
        b, s = mxfp4.quantize(np.ascontiguousarray(moved[idx]))
        blocks[idx], scales[idx] = np.asarray(b), np.asarray(s)
    return blocks, scales


def dequantize_array(blocks: np.ndarray, scales: np.ndarray, axis: int, dtype) -> np.ndarray:
    """Exact float values of packed ``(blocks, scales)``, with the contracting dim moved back to ``axis``."""
    from jaxmoe.quant import mxfp4  # noqa: PLC0415

    moved_shape = (*scales.shape[:-1], scales.shape[-1] * mxfp4.BLOCK)
    out = np.empty(np.moveaxis(np.empty(moved_shape, np.bool_), -1, axis).shape, np.dtype(dtype))
    out_moved = np.moveaxis(out, axis, -1)  # a view of ``out``
    for idx in _row_chunks(moved_shape):
        out_moved[idx] = np.asarray(mxfp4.dequantize(blocks[idx], scales[idx], np.dtype(dtype)))
    return out


def _with_mxfp4(cfg: Config, names: tuple[str, ...]) -> Config:
    """``cfg`` with ``model.mxfp4_weights = names``, validated (a dim not divisible by 32 names its field)."""
    values = config_to_dict(cfg)
    values["model"]["mxfp4_weights"] = list(names)
    return from_config_dict(values)


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# Orbax float <-> Orbax MXFP4


def quantize_checkpoint(src, dst, names: tuple[str, ...] | None = None, *, progress: bool = True) -> dict:
    """Float jaxmoe checkpoint -> MXFP4 one (``names``: weights to pack; default the routed experts)."""
    from jaxmoe.quant import MXFP4_CONTRACTING_AXIS, ROUTED_EXPERTS  # noqa: PLC0415

    reader = CheckpointReader(src)
    if reader.cfg.model.mxfp4_weights:
        raise CheckpointError(
            f"checkpoint {str(reader.path)!r} is already MXFP4 (model.mxfp4_weights={reader.cfg.model.mxfp4_weights})"
        )
    names = tuple(names or ROUTED_EXPERTS)
    cfg = _with_mxfp4(reader.cfg, names)
    with checkpoint_writer(dst, cfg) as writer, _progress(len(reader.arrays), "quantize", progress) as bar:
        for name, (keys, _, _) in reader.arrays.items():
            value = reader.read(name)
            if keys[-1] in names:
                blocks, scales = quantize_array(value, MXFP4_CONTRACTING_AXIS[keys[-1]])
                writer.add((*keys, "blocks"), blocks)
                writer.add((*keys, "scales"), scales)
            else:
                writer.add(keys, value)
            del value
            bar.update()
    return {"src": str(reader.path), "dst": str(pathlib.Path(dst).absolute()), "mxfp4_weights": list(names)}


def dequantize_checkpoint(src, dst, *, progress: bool = True) -> dict:
    """MXFP4 jaxmoe checkpoint -> float one (``model.param_dtype``), exact values."""
    from jaxmoe.quant import MXFP4_CONTRACTING_AXIS  # noqa: PLC0415

    reader = CheckpointReader(src)
    names = reader.cfg.model.mxfp4_weights
    if not names:
        raise CheckpointError(f"checkpoint {str(reader.path)!r} has no MXFP4 weights (model.mxfp4_weights is empty)")
    cfg = _with_mxfp4(reader.cfg, ())
    dtype = np.dtype(jax.numpy.dtype(cfg.model.param_dtype))
    with checkpoint_writer(dst, cfg) as writer, _progress(len(reader.arrays), "dequantize", progress) as bar:
        for name, (keys, _, _) in reader.arrays.items():
            if keys[-1] == "scales" and len(keys) > 1 and keys[-2] in names:
                bar.update()
                continue  # read with its blocks
            if keys[-1] == "blocks" and len(keys) > 1 and keys[-2] in names:
                scales_name = name[: -len("blocks")] + "scales"
                blocks, scales = reader.read(name), reader.read(scales_name)
                writer.add(keys[:-1], dequantize_array(blocks, scales, MXFP4_CONTRACTING_AXIS[keys[-2]], dtype))
            else:
                writer.add(keys, reader.read(name))
            bar.update()
    return {"src": str(reader.path), "dst": str(pathlib.Path(dst).absolute()), "mxfp4_weights": []}


# --------------------------------------------------------------------------------------------
# HF folder -> jaxmoe


class _HFTensors(SafetensorsFolder):
    """HF safetensors tensors by name, read on demand; MXFP4 pairs appear under their float name.

    ``tensors[key]`` is float32. For a key stored as MXFP4 it is the exact dequantized value, or,
    when ``passthrough(key)`` holds, a zero-memory placeholder of the float shape: the caller then
    reads the packed bytes with :meth:`packed` instead. ``used`` collects the stored names read.
    """

    def __init__(self, folder: pathlib.Path, passthrough, rename=None):
        super().__init__(folder, rename)
        self._passthrough = passthrough
        self.packed_names: dict[str, tuple[str, str]] = {}
        for key in self.stored:
            if key.endswith("_blocks"):
                base = key[: -len("_blocks")]
                if base + "_scales" not in self.stored:
                    raise CheckpointError(f"tensor {key!r} has no matching {base + '_scales'!r}")
                name = base if base.endswith(".weight") else base + ".weight"
                if name in self.stored:
                    raise CheckpointError(f"tensor {name!r} is stored both as float and as MXFP4 ({key!r})")
                self.packed_names[name] = (key, base + "_scales")

    def packed(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The stored ``(blocks, scales)`` uint8 of the MXFP4 tensor ``name``."""
        blocks, scales = (self.raw(key) for key in self.packed_names[name])
        if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
            raise CheckpointError(
                f"MXFP4 tensors {self.packed_names[name]} must be uint8 [..., G, 16] and [..., G], got "
                f"{blocks.dtype} {blocks.shape} and {scales.dtype} {scales.shape}"
            )
        return blocks, scales

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self.stored:
            return super().__getitem__(key)
        if key not in self.packed_names:
            raise KeyError(key)
        if self._passthrough(key):
            blocks_shape = self.shape(self.packed_names[key][0])
            return np.broadcast_to(np.float32(0), (*blocks_shape[:-2], blocks_shape[-2] * 32))

        blocks, scales = self.packed(key)
        return dequantize_array(blocks, scales, blocks.ndim - 2, np.float32)

    def __contains__(self, key) -> bool:
        return key in self.stored or key in self.packed_names

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.stored if not k.endswith(("_blocks", "_scales")))
        yield from self.packed_names

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Sink:
    """Stands for an ``nnx.Variable`` in the importer: takes the value and streams it out."""

    def __init__(self, path: tuple, abstract, emit):
        self.path, self._abstract, self._emit, self.filled = path, abstract, emit, False

    def get_value(self):
        return self._abstract

    def set_value(self, value) -> None:
        if self.filled:
            raise CheckpointError(f"model parameter {'/'.join(map(str, self.path))!r} was loaded twice")
        self.filled = True
        self._emit(self.path, value)


def _mirror(node, paths: dict, emit, sinks: list):
    """The abstract model's module tree with every variable replaced by a :class:`_Sink`."""
    if isinstance(node, nnx.Variable):
        sink = _Sink(paths[id(node)], node.get_value(), emit)
        sinks.append(sink)
        return sink
    if isinstance(node, nnx.List):
        return [_mirror(x, paths, emit, sinks) for x in node]
    if isinstance(node, nnx.Module):
        ns = types.SimpleNamespace()
        for k, v in vars(node).items():
            if not k.startswith("_pytree"):
                setattr(ns, k, _mirror(v, paths, emit, sinks))
        return ns
    return node


def _routed_experts_mxfp4(
    tensors: _HFTensors, keys: list[str], value, axis: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(blocks, scales, stored)`` of one stacked routed-expert weight ``value [E, ...]``.

    ``keys`` are the HF names of its experts, in order. When every one is stored as MXFP4 their
    bytes are stacked and passed through (``stored`` True; ``value`` is then a placeholder of the
    right shape); when none is, ``value`` is quantized along ``axis``; a mix is refused.
    """
    packed = [k in tensors.packed_names for k in keys]
    if any(packed) and not all(packed):
        raise CheckpointError(f"routed experts {keys[0]!r}...: some are stored as MXFP4 and some as float; all or none")
    if not all(packed):
        return (*quantize_array(value, axis), False)
    parts = [tensors.packed(k) for k in keys]
    blocks, scales = np.stack([b for b, _ in parts]), np.stack([s for _, s in parts])
    want = quantize_shapes(value.shape, axis)
    if (blocks.shape, scales.shape) != want:
        raise CheckpointError(
            f"MXFP4 tensors {keys[0]}_blocks/_scales... stack to {blocks.shape} and {scales.shape}, "
            f"the model expects {want[0]} and {want[1]}"
        )
    return blocks, scales, True


def _refuse_incomplete(sinks: list[_Sink], tensors: _HFTensors, written: set[str], expected: set[str], src, cfg):
    """Raises unless every model parameter was filled, every stored tensor read and every array written."""
    from jaxmoe.checkpoint.hf_import import refuse_unused  # noqa: PLC0415

    missing = [s.path for s in sinks if not s.filled]
    if missing:
        raise CheckpointError(f"the HF importer did not provide model parameters {missing[:3]}")
    refuse_unused(tensors, src, cfg.model.num_layers)
    if written != expected:
        raise CheckpointError(f"converted arrays differ from the model's: {sorted(written ^ expected)[:3]}")


def _check_tokenizer(src: pathlib.Path, vocab_size: int) -> Tokenizer | None:
    """The source's tokenizer (None if it has no tokenizer.json), refused before any tensor is converted
    if it cannot be read or has more tokens than the model."""
    if not (src / TOKENIZER_FILE).is_file():
        return None
    try:
        tokenizer = Tokenizer.load(src)
    except ValueError as e:
        raise CheckpointError(f"the HF folder's tokenizer cannot be read: {e}") from e
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"{src / TOKENIZER_FILE} has {tokenizer.vocab_size} tokens, more than the model's vocab_size {vocab_size}"
        )
    return tokenizer


def _copy_tokenizer(src: pathlib.Path, dst: pathlib.Path, hf: dict) -> list[str]:
    """Copies the tokenizer files of ``src`` into ``dst``; writes config.json's eos_token_id as a
    generation_config.json when ``src`` has none. Returns the names of the files written."""
    files = copy_tokenizer_files(src, dst)
    eos = hf.get("eos_token_id")
    if GENERATION_CONFIG_FILE not in files and eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise CheckpointError(f"HF config.json: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
        (dst / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": eos}) + "\n")
        files.append(GENERATION_CONFIG_FILE)
    return files


def convert_hf(src, dst, quant: str | None = None, *, progress: bool = True) -> dict:
    """HF folder (``deepseek_v3``, ``deepseek_v32``, ``kimi_linear``, ``kimi_k25``) -> jaxmoe checkpoint, by tensor.

    Args:
        src: folder with ``config.json`` and ``model.safetensors`` (or an index and shards).
        dst: the new checkpoint directory.
        quant: None (float, ``model.param_dtype``) or ``"mxfp4"`` (routed experts packed).

    Returns:
        A summary dict (src, dst, layers, mxfp4_weights, passed_through: MXFP4 tensors kept as
        stored, tokenizer_files: the tokenizer files written beside the params).
    """
    from jaxmoe.checkpoint.hf_import import (  # noqa: PLC0415
        FFN_LAYOUT,
        config_from_hf,
        load_weights,
        read_hf_config,
        tensor_names,
    )
    from jaxmoe.model import abstract_model  # noqa: PLC0415
    from jaxmoe.quant import MXFP4_CONTRACTING_AXIS, ROUTED_EXPERTS  # noqa: PLC0415

    if quant not in (None, *QUANT_FORMATS):
        raise CheckpointError(f"--quant {quant!r} is not supported; allowed: {QUANT_FORMATS}")
    src = pathlib.Path(src)
    hf = read_hf_config(src)
    float_cfg = config_from_hf(hf)
    names = tuple(ROUTED_EXPERTS) if quant else ()
    cfg = _with_mxfp4(float_cfg, names) if quant else float_cfg
    _check_tokenizer(src, cfg.model.vocab_size)
    ffn_prefix, expert_names = FFN_LAYOUT[hf["model_type"]]
    hf_name = dict(zip(("w_gate", "w_up", "w_down"), expert_names))
    expert_key = re.compile(
        rf"model\.layers\.\d+\.{re.escape(ffn_prefix)}experts\.\d+\.({'|'.join(expert_names)})\.weight"
    )
    tensors = _HFTensors(
        src, passthrough=lambda key: bool(quant) and expert_key.fullmatch(key) is not None, rename=tensor_names(hf)
    )

    abstract = abstract_model(float_cfg.model)
    paths = {id(v): tuple(p) for p, v in nnx.iter_graph(abstract) if isinstance(v, nnx.Variable)}
    expected = {
        "/".join(map(str, p)) for p, v in nnx.iter_graph(abstract_model(cfg.model)) if isinstance(v, nnx.Variable)
    }
    passed = []
    with checkpoint_writer(dst, cfg) as writer, _progress(len(paths), "convert", progress) as bar:

        def emit(path: tuple, value) -> None:
            if path[-1] not in names:
                writer.add(path, value)
            else:
                layer = path[path.index("layers") + 1]
                keys = [
                    f"model.layers.{layer}.{ffn_prefix}experts.{e}.{hf_name[path[-1]]}.weight"
                    for e in range(cfg.model.moe.num_experts)
                ]
                blocks, scales, stored = _routed_experts_mxfp4(tensors, keys, value, MXFP4_CONTRACTING_AXIS[path[-1]])
                del value
                if stored:
                    passed.extend(keys)
                writer.add((*path, "blocks"), blocks)
                writer.add((*path, "scales"), scales)
            bar.update()

        sinks: list[_Sink] = []
        load_weights(_mirror(abstract, paths, emit, sinks), tensors, hf["model_type"])
        _refuse_incomplete(sinks, tensors, set(writer.records), expected, src, cfg)
        # Into the staging directory (the params' parent), so dst appears with its tokenizer.
        tokenizer_files = _copy_tokenizer(src, writer.directory.parent, hf)
    return {
        "src": str(src),
        "dst": str(pathlib.Path(dst).absolute()),
        "layers": list(cfg.model.layer_kinds),
        "mxfp4_weights": list(names),
        "passed_through": len(passed),
        "tokenizer_files": tokenizer_files,
    }


def quantize_shapes(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(blocks, scales)`` shapes of a weight of logical ``shape`` packed along ``axis``."""
    from jaxmoe.quant import mxfp4  # noqa: PLC0415

    shape = tuple(shape)
    return mxfp4.packed_shapes(shape[:axis] + shape[axis + 1 :] + (shape[axis],))


__all__ = [
    "convert_hf",
    "dequantize_array",
    "dequantize_checkpoint",
    "quantize_array",
    "quantize_checkpoint",
]
