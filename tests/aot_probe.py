"""Run by tests/test_aot.py in a subprocess: libtpu describes the TPU slice there, never in pytest's process.

    python tests/aot_probe.py CONFIG TOPOLOGY [KEY=VALUE ...]

Compiles the config's train step for ``TOPOLOGY`` and for the same mesh on 8 CPU devices, then
prints one JSON line: the TPU report (:func:`jaxmoe.aot.compile_report`'s fields) and, for each
compile, every argument's and output's shape, dtype, PartitionSpec and per-device shard shape and
XLA's memory analysis, the TPU forward of the config with ``dispatch=ragged`` (the
``ragged_all_to_all`` path that XLA:CPU cannot compile), and the engine's decode step (MXFP4
experts, paged pools for 4 sequences of 256 tokens) on data 2 x fsdp 2 x expert 2, for the slice
and on CPU.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxmoe import aot  # noqa: E402
from jaxmoe.config import from_config_dict, load_config_dict  # noqa: E402
from jaxmoe.sharding import make_mesh  # noqa: E402
from jaxmoe.train.overrides import apply_overrides  # noqa: E402


def _layout(compiled, lowered) -> dict:
    """Shapes, dtypes, specs and shard shapes of a compiled step's arguments and outputs."""

    def leaves(infos, shardings):
        out = []
        for info, s in zip(jax.tree.leaves(infos), jax.tree.leaves(shardings), strict=True):
            out.append([list(info.shape), str(info.dtype), str(s.spec), list(s.shard_shape(info.shape))])
        return out

    args_info = lowered.args_info[0]
    return {
        "inputs": leaves(args_info, compiled.input_shardings[0]),
        "outputs": leaves(lowered.out_info, compiled.output_shardings),
        "memory": aot.memory(compiled),
    }


def main(path: str, topology: str, *overrides: str) -> None:
    pairs = [tuple(o.split("=", 1)) for o in overrides]
    cfg = from_config_dict(apply_overrides(load_config_dict(path), pairs))
    tpu = aot.compile_for(cfg, topology)
    out = {"report": tpu.report, "tpu": _layout(tpu.compiled, tpu.lowered)}
    lowered, _ = aot.lower_step(cfg, make_mesh(cfg.mesh), "train")
    out["cpu"] = _layout(lowered.compile(), lowered)
    ragged = from_config_dict(apply_overrides(load_config_dict(path), [*pairs, ("model.moe.dispatch", "ragged")]))
    out["ragged_forward"] = aot.compile_report(ragged, topology, step="forward")
    # The engine's decode step, on a mesh without context (the engine's): TPU, then the same on CPU.
    mesh = [("mesh.data", "2"), ("mesh.fsdp", "2"), ("mesh.expert", "2"), ("mesh.context", "1")]
    serving_cfg = from_config_dict(apply_overrides(load_config_dict(path), [*pairs, *mesh]))
    serving = aot.Serving(seqs=4, context=256)
    decode = aot.compile_for(serving_cfg, topology, step="decode", serving=serving)
    out["decode"] = {"report": decode.report, "tpu": _layout(decode.compiled, decode.lowered)}
    lowered, _ = aot.lower_decode(serving_cfg, make_mesh(serving_cfg.mesh), serving)
    out["decode"]["cpu"] = _layout(lowered.compile(), lowered)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
