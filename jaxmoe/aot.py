"""Ahead-of-time compilation of the real steps for a TPU topology on a CPU host: per-chip memory and FLOPs.

    jaxmoe compile --config configs/target.py --topology v5p:8x16x16 [--step train|forward] [--config.KEY=VALUE ...]

With ``libtpu`` installed (the ``tpu`` or ``test`` extra), ``jax.experimental.topologies`` describes
a TPU slice's devices without any TPU attached. :func:`compile_report` lays the config's mesh onto
those devices (:func:`jaxmoe.sharding.make_mesh`, the placement ``jaxmoe train`` uses on the real
slice), builds the abstract sharded train state and batch (``ShapeDtypeStruct`` with shardings, no
weights allocated), lowers and compiles the very function ``jaxmoe train`` runs (its remat policy,
optimizer state, MoE dispatch, donated state) and reads XLA's own ``memory_analysis()`` and
``cost_analysis()`` of the program one device runs.

Memory per device, as XLA reports it: ``argument_bytes`` (the state shard and the batch shard),
``output_bytes``, ``alias_bytes`` (outputs written in place of donated arguments: the new state),
``temp_bytes`` (activations, gradients, collectives' buffers) and ``generated_code_bytes``;
``total_bytes = argument + output - alias + temp + generated_code`` is what the program needs at
once, ``fits`` compares it with the device's HBM (:data:`CHIPS`).
"""

from __future__ import annotations

import re
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import Config, ConfigError
from jaxmoe.rules import MESH_AXES
from jaxmoe.topology import CHIPS, TopologyError, check_mesh, chip_kind

STEPS = ("train", "forward", "decode")


def topology_devices(topology: str, slices: int = 1) -> list:
    """The devices of ``slices`` TPU slices of ``topology``, described by libtpu on this (CPU) host."""
    chip_kind(topology)
    try:
        import libtpu  # noqa: F401, PLC0415  (only to say what is missing)
    except ImportError as e:
        raise TopologyError(
            "jaxmoe compile needs libtpu to compile for a TPU topology: pip install -e '.[tpu]' "
            f"(or 'jax[tpu]=={jax.__version__}')"
        ) from e
    from jax.experimental import topologies  # noqa: PLC0415

    kwargs = {"num_slices": slices} if slices > 1 else {}
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs).devices)
    except Exception as e:  # libtpu rejects the name: its own message says why
        raise TopologyError(f"--topology {topology!r}: libtpu cannot describe it: {e}") from e


def slice_mesh(cfg: Config, topology: str, devices: list) -> jax.sharding.Mesh:
    """The config's mesh (:func:`check_mesh`-ed) laid onto the slices' devices, or a :class:`TopologyError`."""
    from jaxmoe.sharding import make_mesh  # noqa: PLC0415

    if len(devices) != cfg.mesh.num_devices:  # a chip kind with several devices a chip
        raise TopologyError(f"topology {topology} has {len(devices)} devices for {cfg.mesh.num_devices} mesh positions")
    try:
        return make_mesh(cfg.mesh, devices)
    except (ValueError, AssertionError, NotImplementedError) as e:
        raise TopologyError(
            f"mesh {dict(zip(MESH_AXES, cfg.mesh.shape))} does not map onto the {topology} torus: {e}"
        ) from e


def memory(compiled) -> dict[str, int]:
    """XLA's per-device bytes of a compiled program (the module docstring says what each means)."""
    m = compiled.memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
    }
    out["total_bytes"] = (
        out["argument_bytes"]
        + out["output_bytes"]
        - out["alias_bytes"]
        + out["temp_bytes"]
        + out["generated_code_bytes"]
    )
    return out


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def exhausted_memory(message: str) -> dict[str, int] | None:
    """What a TPU compile that ran out of HBM says it needed: ``{"temp_bytes": ...}`` (or
    ``"argument_bytes"``) from XLA's ``RESOURCE_EXHAUSTED`` message; None for any other error.

    XLA refuses a program that cannot fit instead of returning its memory analysis, and names the
    bytes it needed (``... required for HLO temporaries (943.56G) exceeds available HBM ...``).
    """
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    m = re.search(r"required for (HLO temporaries|arguments)[^(]*\(([\d.]+)([KMGTP]?)i?B?\)", message)
    if m is None:
        return None
    key = "temp_bytes" if m.group(1) == "HLO temporaries" else "argument_bytes"
    return {key: int(float(m.group(2)) * _UNITS[m.group(3)])}


def _compile(lowered) -> tuple[Any, dict[str, int], str | None]:
    """``(compiled, memory, None)``, or ``(None, the bytes XLA said it needed, its message)`` when
    XLA refuses the program for want of HBM (``total_bytes`` then a lower bound)."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        needed = exhausted_memory(str(e))
        if needed is None:
            raise
        return None, {**needed, "total_bytes": max(needed.values())}, str(e).splitlines()[0]
    return compiled, memory(compiled), None


def _flops(compiled) -> float:
    return float((compiled.cost_analysis() or {}).get("flops", 0.0))


class Serving(NamedTuple):
    """What the decode step serves: ``seqs`` sequences of ``context`` tokens each, paged by ``page_size``."""

    seqs: int = 1
    context: int | None = None  # None: the model's max_context
    page_size: int = 16


def lower_decode(cfg: Config, mesh: jax.sharding.Mesh, serving: Serving):
    """``(lowered, cache spec)`` of the engine's decode step on ``mesh``: every routed expert in
    MXFP4, the weights sharded by the training rules, the paged pools sized for ``serving`` (the
    engine's layout: replicated on every device), one new token for each of the sequences."""
    import dataclasses  # noqa: PLC0415

    from flax import nnx  # noqa: PLC0415

    from jaxmoe.config import MXFP4_WEIGHTS, validate  # noqa: PLC0415
    from jaxmoe.inference.allocator import pages_for  # noqa: PLC0415
    from jaxmoe.inference.cache import CacheSpec  # noqa: PLC0415
    from jaxmoe.inference.engine import _step_jit  # noqa: PLC0415
    from jaxmoe.inference.programs import Shape, abstract_inputs, step_key  # noqa: PLC0415
    from jaxmoe.model import abstract_model  # noqa: PLC0415
    from jaxmoe.sharding import state_shardings  # noqa: PLC0415

    context = serving.context or cfg.model.max_context
    for name, value in (("--seqs", serving.seqs), ("--context", context), ("--page-size", serving.page_size)):
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}")
    if context > cfg.model.max_context:
        raise ConfigError(f"--context {context} is longer than model.max_context={cfg.model.max_context}")
    model_cfg = dataclasses.replace(cfg.model, mxfp4_weights=tuple(MXFP4_WEIGHTS))
    validate(dataclasses.replace(cfg, model=model_cfg))  # the MXFP4 blocks must divide over the mesh
    graphdef, state = nnx.split(abstract_model(model_cfg))
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    pages = pages_for(context, serving.page_size)
    spec = CacheSpec.for_model(
        model_cfg, num_pages=serving.seqs * pages + 1, num_slots=serving.seqs, page_size=serving.page_size
    )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cache = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), jax.eval_shape(spec.init)
    )
    groups, sampling = abstract_inputs(Shape(serving.seqs, 0, 0, pages, False), model_cfg.vocab_size)
    with jax.set_mesh(mesh):
        lowered = _step_jit.lower(step_key(graphdef, spec), False, state, cache, groups, sampling)
    return lowered, spec


def lower_step(cfg: Config, mesh: jax.sharding.Mesh, step: str, stage: str = "main"):
    """``(lowered, tokens per step)`` of ``step`` (train or forward) on ``mesh`` from abstract
    sharded inputs (no weights)."""
    from jaxmoe.train.step import STAGES, Trainer  # noqa: PLC0415

    if step not in STEPS[:2]:
        raise ConfigError(f"--step must be one of {STEPS}, got {step!r}")
    if stage not in STAGES:
        raise ConfigError(f"--stage must be one of {STAGES}, got {stage!r}")
    t = cfg.train
    trainer = Trainer(cfg, mesh)  # outside the mesh: its abstract model draws concrete host keys
    state = trainer.abstract_state()
    batch = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=trainer.batch_sharding)
    with jax.set_mesh(mesh):
        lowered = trainer.lower(step, stage, state, batch, batch)
    return lowered, t.batch_size * t.seq_len


class Compiled(NamedTuple):
    """What :func:`compile_for` made: the JSON-able report, and the lowered and compiled step."""

    report: dict[str, Any]
    lowered: jax.stages.Lowered
    compiled: jax.stages.Compiled


def compile_report(
    cfg: Config,
    topology: str,
    step: str = "train",
    stage: str = "main",
    slices: int = 1,
    serving: Serving | None = None,
) -> dict[str, Any]:
    """:func:`compile_for`'s report."""
    return compile_for(cfg, topology, step, stage, slices, serving).report


def compile_for(
    cfg: Config,
    topology: str,
    step: str = "train",
    stage: str = "main",
    slices: int = 1,
    serving: Serving | None = None,
) -> Compiled:
    """Compiles ``step`` of ``cfg`` for ``topology`` and reports XLA's per-device memory and FLOPs.

    Returns:
      The report, one JSON-able record: ``topology``, ``chips``, ``devices``, ``mesh`` (axis sizes), ``step``,
      the per-device bytes of :func:`memory`, ``hbm_bytes`` (per device), ``fits``, ``margin``
      (the share of HBM left), ``flops_per_step`` (all devices), ``flops_per_token``,
      ``model_flops_per_token`` (train step: the analytic count the train loop's MFU uses),
      ``lower_s`` and ``compile_s``. Where XLA refuses the program for want of HBM, the report
      says so (``fits`` false, ``compile_error``), holds the bytes XLA said it needed (``total_bytes``
      a lower bound) and no FLOPs, and ``compiled`` is None. The decode step (the engine's,
      :func:`lower_decode`) reports
      ``seqs``, ``context``, ``page_size`` and ``cache_bytes`` (its pools, on every device) instead
      of the batch and the train fields; a token is one sequence's new token.

    Raises:
      TopologyError: unknown topology, no libtpu, or a mesh that does not fit the slice.
    """
    from jaxmoe.train.metrics import model_flops_per_token  # noqa: PLC0415

    serving = serving or Serving()
    kind = chip_kind(topology)
    chips = check_mesh(cfg, topology, slices)["chips"]  # before libtpu: a mismatch needs no TPU description
    devices = topology_devices(topology, slices)
    mesh = slice_mesh(cfg, topology, devices)
    start = time.perf_counter()
    if step == "decode":
        lowered, spec = lower_decode(cfg, mesh, serving)
        tokens = serving.seqs
    else:
        lowered, tokens = lower_step(cfg, mesh, step, stage)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    hbm = CHIPS[kind].hbm_bytes  # one device a chip (slice_mesh checked)
    compiled, mem, error = _compile(lowered)
    compile_s = time.perf_counter() - start
    flops = _flops(compiled) * len(devices) if compiled is not None else None
    report = {
        "topology": topology,
        **({"slices": slices} if slices > 1 else {}),
        "chips": chips,
        "devices": len(devices),
        "mesh": dict(zip(MESH_AXES, cfg.mesh.shape)),
        "step": step,
        **(
            {
                "seqs": serving.seqs,
                "context": serving.context or cfg.model.max_context,
                "page_size": serving.page_size,
                "cache_bytes": spec.total_bytes,
            }
            if step == "decode"
            else {
                "stage": stage,
                "batch_size": cfg.train.batch_size,
                "seq_len": cfg.train.seq_len,
                "remat": cfg.train.remat,
            }
        ),
        "num_layers": cfg.model.num_layers,
        "dispatch": cfg.model.moe.dispatch,
        **mem,
        "hbm_bytes": hbm,
        "fits": error is None and mem["total_bytes"] <= hbm,
        "margin": round(1 - mem["total_bytes"] / hbm, 4),
        **({"compile_error": error} if error else {}),
        "flops_per_step": flops,
        "flops_per_token": flops / tokens if flops is not None else None,
        **({"model_flops_per_token": model_flops_per_token(cfg, stage)} if step == "train" else {}),
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
    }
    return Compiled(report, lowered, compiled)
