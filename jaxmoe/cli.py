"""The ``jaxmoe`` command line: ``info``, ``convert``, ``logits``, ``train``, ``compile``, ``generate``, ``serve``,
``agent``, ``rl``.

Every subcommand has ``--help``. Bad arguments exit with status 2 and a message naming the
argument; bad configs and checkpoints exit with status 1 and a message naming the field or tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from jaxmoe.config import ConfigError
from jaxmoe.errors import CheckpointError


def _cmd_info(args) -> int:
    from jaxmoe.config import load_config  # noqa: PLC0415 (keep --help fast)
    from jaxmoe.info import model_info  # noqa: PLC0415

    print(json.dumps(model_info(load_config(args.config))))
    return 0


def _cmd_convert_hf(args) -> int:
    from jaxmoe.checkpoint.convert import convert_hf  # noqa: PLC0415 (keep --help fast)

    print(json.dumps(convert_hf(args.src, args.dst, quant=args.quant, progress=not args.no_progress)))
    return 0


def _cmd_convert_quantize(args) -> int:
    from jaxmoe.checkpoint.convert import quantize_checkpoint  # noqa: PLC0415

    print(json.dumps(quantize_checkpoint(args.src, args.dst, progress=not args.no_progress)))
    return 0


def _cmd_convert_dequantize(args) -> int:
    from jaxmoe.checkpoint.convert import dequantize_checkpoint  # noqa: PLC0415

    print(json.dumps(dequantize_checkpoint(args.src, args.dst, progress=not args.no_progress)))
    return 0


def _logits_images(args, cfg, tokens):
    """The tower's inputs for ``--pixel-values`` and ``--image-grid`` (None without them), checked."""
    import numpy as np  # noqa: PLC0415

    from jaxmoe.vision import image_grids, merged_tokens, vision_inputs  # noqa: PLC0415

    if (args.pixel_values is None) != (args.image_grid is None):
        raise SystemExit("jaxmoe logits: error: give --pixel-values and --image-grid together")
    if args.pixel_values is None:
        return None
    vision = cfg.model.vision
    if vision is None:
        raise SystemExit("jaxmoe logits: error: --pixel-values given, but the checkpoint's model has no vision tower")
    try:
        pixels = np.load(args.pixel_values, allow_pickle=False)
        grid = np.load(args.image_grid, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise SystemExit(f"jaxmoe logits: error: --pixel-values / --image-grid: not a readable .npy file ({e})") from e
    try:
        grids = image_grids(grid, vision)
        inputs = vision_inputs(pixels, grids, vision)
    except ValueError as e:
        raise SystemExit(f"jaxmoe logits: error: --image-grid / --pixel-values: {e}") from e
    placeholders = int((tokens == vision.image_token_id).sum())
    if placeholders != merged_tokens(grids, vision):
        raise SystemExit(
            f"jaxmoe logits: error: --tokens hold {placeholders} image placeholder ids ({vision.image_token_id}), "
            f"the images make {merged_tokens(grids, vision)} tokens"
        )
    return inputs


def _cmd_logits(args) -> int:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jaxmoe.checkpoint.io import load_model  # noqa: PLC0415

    try:
        tokens = np.load(args.tokens, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise SystemExit(f"jaxmoe logits: error: --tokens {args.tokens!r} is not a readable .npy file ({e})") from e
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise SystemExit(
            f"jaxmoe logits: error: --tokens must hold an integer [B, T] array, got {tokens.dtype} {tokens.shape}"
        )
    cfg, model = load_model(args.checkpoint)
    vocab = cfg.model.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise SystemExit(
            f"jaxmoe logits: error: --tokens ids must lie in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]"
        )
    images = _logits_images(args, cfg, tokens)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, images):
        return nnx.merge(graphdef, state)(tokens, images=images)

    logits = np.asarray(forward(state, tokens.astype(np.int32), images), dtype=np.float32)
    np.save(args.out, logits)
    print(json.dumps({"out": str(args.out), "shape": list(logits.shape)}))
    return 0


# Environment variables set on Cloud TPU VMs (and by GKE's TPU / multislice set-up): their presence
# means jax.distributed.initialize() can find its coordinator by itself.
CLOUD_TPU_ENV = ("TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID", "MEGASCALE_COORDINATOR_ADDRESS")


def _init_distributed(args, parser: argparse.ArgumentParser) -> None:
    """``jax.distributed.initialize`` from the flags, or by itself on Cloud TPU (``--multihost auto``)."""
    given = {
        "--coordinator_address": args.coordinator_address,
        "--num_processes": args.num_processes,
        "--process_id": args.process_id,
    }
    if args.heartbeat_timeout < 1:
        parser.error(f"--heartbeat_timeout must be a positive number of seconds, got {args.heartbeat_timeout}")
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            parser.error(f"{', '.join(missing)} missing: multi-process runs need all of {', '.join(given)}")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process_id must be in [0, --num_processes={args.num_processes}), got {args.process_id}")
        import jax  # noqa: PLC0415

        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    elif args.multihost == "auto" and any(k in os.environ for k in CLOUD_TPU_ENV):
        import jax  # noqa: PLC0415

        jax.distributed.initialize(heartbeat_timeout_seconds=args.heartbeat_timeout)


def _cmd_train(args) -> int:
    from jaxmoe.config import _to_plain, from_config_dict, load_config_dict  # noqa: PLC0415
    from jaxmoe.train.overrides import apply_overrides  # noqa: PLC0415

    d = _to_plain(load_config_dict(args.config))
    if "vl" in d:  # the image-text job
        from jaxmoe.vision.train import load_vl_config  # noqa: PLC0415

        cfg, vl = load_vl_config(args.config, args.overrides)
    else:
        cfg, vl = from_config_dict(apply_overrides(d, args.overrides)), None
    _init_distributed(args, args.parser)
    from jaxmoe.train.loop import summary_line, train  # noqa: PLC0415

    if vl is not None:
        from jaxmoe.vision.train import train_vl  # noqa: PLC0415

        summary = train_vl(cfg, vl, args.workdir, progress=not args.no_progress)
    else:
        summary = train(cfg, args.workdir, progress=not args.no_progress)
    import jax  # noqa: PLC0415

    if jax.process_index() == 0:
        print(summary_line(summary), flush=True)
    return 0


def _cmd_rl(args) -> int:
    from jaxmoe.rl.config import load_rl_config  # noqa: PLC0415

    cfg, rl = load_rl_config(args.config, args.overrides)
    _init_distributed(args, args.parser)
    from jaxmoe.rl.loop import train_rl  # noqa: PLC0415
    from jaxmoe.train.loop import summary_line  # noqa: PLC0415

    summary = train_rl(cfg, rl, args.workdir, args.init, progress=not args.no_progress)
    import jax  # noqa: PLC0415

    if jax.process_index() == 0:
        print(summary_line(summary), flush=True)
    return 0


def _cmd_compile(args) -> int:
    from jaxmoe.config import from_config_dict, load_config_dict  # noqa: PLC0415
    from jaxmoe.topology import TopologyError, accelerator_topology, check_mesh  # noqa: PLC0415
    from jaxmoe.train.overrides import apply_overrides  # noqa: PLC0415

    if args.slices < 1:
        args.parser.error(f"--slices must be a positive integer, got {args.slices}")
    cfg = from_config_dict(apply_overrides(load_config_dict(args.config), args.overrides))
    topology = args.topology
    try:
        topology = topology or accelerator_topology(args.accelerator_type)
        if args.mesh_only:
            report = check_mesh(cfg, topology, args.slices)
        else:
            from jaxmoe.aot import Serving, compile_report  # noqa: PLC0415

            serving = Serving(args.seqs, args.context, args.page_size)
            report = compile_report(cfg, topology, args.step, args.stage, args.slices, serving)
    except TopologyError as e:
        where = f" (--accelerator-type {args.accelerator_type} is {topology})" if args.accelerator_type else ""
        print(f"jaxmoe compile: error: {e}{where}", file=sys.stderr)
        return 1
    if args.accelerator_type:
        report = {"accelerator_type": args.accelerator_type, **report}
    print(json.dumps(report), flush=True)
    if args.check and not report.get("fits", True):
        print(
            f"jaxmoe compile: the {report['step']} step needs {report['total_bytes'] / 1e9:.1f} GB per chip; "
            f"a {topology} chip has {report['hbm_bytes'] / 1e9:.1f} GB",
            file=sys.stderr,
        )
        return 3
    return 0


def _add_compile(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compile",
        help="compile a config's step for a TPU topology on this (CPU) host; one JSON line of XLA's per-chip "
        "memory and FLOPs",
        epilog="Example: jaxmoe compile --config configs/target.py --topology v5p:8x16x16. Needs libtpu "
        "(pip install -e '.[tpu]') except with --mesh-only. Exit status: 0, 1 (bad config, topology or mesh), "
        "2 (bad arguments), 3 (--check and the step does not fit).",
    )
    p.add_argument("--config", required=True, help="ml_collections config file (FILE or FILE:ARG)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="TPU slice as KIND:AxBxC: v5p:4x4x4, v5p:8x16x16, v6e:16x16, v4:4x4x4")
    where.add_argument(
        "--accelerator-type", help="or a Cloud TPU type (v5p-128, v6e-256, v5litepod-16): its default topology"
    )
    p.add_argument("--slices", type=int, default=1, help="number of such slices (multi-slice, over DCN); default 1")
    p.add_argument(
        "--step",
        choices=("train", "forward", "decode"),
        default="train",
        help="the train step (default), the forward loss, or the engine's decode step (MXFP4 experts, paged caches)",
    )
    p.add_argument("--seqs", type=int, default=1, help="decode: concurrent sequences, one new token each (default 1)")
    p.add_argument("--context", type=int, help="decode: tokens cached per sequence (default: model.max_context)")
    p.add_argument("--page-size", type=int, default=16, help="decode: positions per cache page (default 16)")
    p.add_argument("--stage", choices=("main", "warmup"), default="main", help="train stage (default main: sparse DSA)")
    p.add_argument(
        "--mesh-only",
        action="store_true",
        help="only check that the config's mesh has one device per chip of the slices (no compile, no libtpu)",
    )
    p.add_argument("--check", action="store_true", help="exit with status 3 when the compiled step does not fit")
    p.set_defaults(fn=_cmd_compile, parser=p)
    return p


def _engine_config(args):
    from jaxmoe.inference import EngineConfig  # noqa: PLC0415

    for flag in ("max_seqs", "page_size", "chunk_size"):
        if getattr(args, flag) < 1:
            args.parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.cache_gb > 0:
        args.parser.error(f"--cache-gb must be > 0, got {args.cache_gb}")
    return EngineConfig(
        cache_bytes=int(args.cache_gb * 2**30),
        page_size=args.page_size,
        max_seqs=args.max_seqs,
        step_tokens=max(args.step_tokens, args.max_seqs),
        chunk_size=args.chunk_size,
    )


def _cmd_generate(args) -> int:
    from jaxmoe.inference.generate import RequestError, generate, parse_mesh, run_requests  # noqa: PLC0415

    if (args.prompt is None) == (args.requests is None):
        args.parser.error("give exactly one of --prompt TEXT or --requests IN.jsonl")
    if args.image and args.prompt is None:
        args.parser.error("--image goes with --prompt (the question about the images)")
    if args.requests is not None and args.out is None:
        args.parser.error("--requests needs --out OUT.jsonl")
    if args.max_new_tokens < 1:
        args.parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        args.parser.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    config = _engine_config(args)
    _init_distributed(args, args.parser)
    try:
        mesh = parse_mesh(args.mesh) if args.mesh is not None else None
    except ValueError as e:
        args.parser.error(str(e))
    if mesh is not None and args.requests is None:
        args.parser.error("--mesh goes with --requests")
    try:
        if args.requests is not None:
            run_requests(
                args.checkpoint, args.requests, args.out, engine_config=config, mesh=mesh, progress=not args.no_progress
            )
            return 0
        out = generate(
            args.checkpoint,
            args.prompt,
            images=args.image,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            engine_config=config,
        )
    except RequestError as e:
        print(f"jaxmoe generate: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
    return 0


def _add_convert(sub) -> None:
    convert = sub.add_parser("convert", help="checkpoint conversion")
    csub = convert.add_subparsers(dest="convert_command", required=True, metavar="FORMAT")
    hf = csub.add_parser("hf", help="HF folder (deepseek_v3 / deepseek_v32 / kimi_linear) to a jaxmoe checkpoint")
    hf.add_argument("src", type=pathlib.Path, help="folder with config.json and *.safetensors")
    hf.add_argument("dst", type=pathlib.Path, help="new checkpoint directory")
    hf.add_argument(
        "--quant",
        choices=("mxfp4",),
        default=None,
        help="store the routed experts in MXFP4 (HF *_blocks/*_scales MXFP4 tensors pass through unchanged)",
    )
    hf.set_defaults(fn=_cmd_convert_hf)
    quantize = csub.add_parser("quantize", help="float jaxmoe checkpoint to MXFP4 (routed experts)")
    quantize.set_defaults(fn=_cmd_convert_quantize)
    dequantize = csub.add_parser("dequantize", help="MXFP4 jaxmoe checkpoint to float (exact values)")
    dequantize.set_defaults(fn=_cmd_convert_dequantize)
    for sp in (quantize, dequantize):
        sp.add_argument("src", type=pathlib.Path, help="jaxmoe checkpoint directory")
        sp.add_argument("dst", type=pathlib.Path, help="new checkpoint directory")
    for sp in (hf, quantize, dequantize):
        sp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_train(sub) -> argparse.ArgumentParser:
    train = sub.add_parser(
        "train",
        help="train a config (resumes from DIR/checkpoints); --config.KEY=VALUE overrides any config field",
        epilog="Config overrides: --config.steps=200 --config.optim.learning_rate=1e-3 --config.mesh.context=2 "
        "(typed by the field; tuples as Python literals). FILE:ARG passes ARG to get_config.",
    )
    train.add_argument("--config", required=True, help="ml_collections config file (FILE or FILE:ARG)")
    train.add_argument(
        "--workdir", required=True, help="run directory (checkpoints, metrics): a local path or a bucket, gs://B/P"
    )
    _add_distributed_flags(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    train.set_defaults(fn=_cmd_train)
    return train


def _add_rl(sub) -> argparse.ArgumentParser:
    rl = sub.add_parser(
        "rl",
        help="GRPO post-training of a trained run: engine rollouts over verifiable-reward domains (resumes from "
        "DIR/checkpoints)",
        epilog="Config overrides: --config.rl.steps=20 --config.rl.group_size=4 --config.rl.thinking.max=12 "
        "(rl.* the RL section, any other key the model/mesh as for train).",
    )
    rl.add_argument("--config", required=True, help="config file with an rl section (e.g. configs/tiny.py:rl)")
    rl.add_argument("--workdir", required=True, help="the RL run directory (checkpoints, metrics)")
    rl.add_argument("--init", required=True, help="the training workdir (or its checkpoints/ root) to start from")
    _add_distributed_flags(rl)
    rl.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rl.set_defaults(fn=_cmd_rl)
    return rl


def _add_distributed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0 (multi-process runs)")
    p.add_argument("--num_processes", type=int, default=None, help="number of processes (multi-process runs)")
    p.add_argument("--process_id", type=int, default=None, help="this process's index (multi-process runs)")
    p.add_argument(
        "--heartbeat_timeout",
        type=int,
        default=100,
        help="seconds without a heartbeat before the coordinator declares a process dead (multi-process and Cloud "
        "TPU runs; default 100, JAX's); raise it on hosts whose compiles can starve a process for longer",
    )
    p.add_argument(
        "--multihost",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): on Cloud TPU, call jax.distributed.initialize() by itself; off: never (unless the "
        "three flags above are given)",
    )


def _add_generate(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="sample from a trained workdir or checkpoint through the inference engine",
        description="--prompt TEXT continues one text; --requests IN.jsonl --out OUT.jsonl runs every request of "
        "the file together (lines {\"prompt_ids\": [...]} or {\"prompt\": TEXT}, optional max_tokens, temperature, "
        "top_p, top_k, seed, stop, ignore_eos).",
    )
    gen.add_argument(
        "--checkpoint",
        required=True,
        help="training workdir, its checkpoints/ root, or a model checkpoint (e.g. DIR/export_mxfp4); local or gs://",
    )
    gen.add_argument("--prompt", default=None, help="text to continue (with --image: the question about the images)")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, GIF, BMP) for a model with a vision tower; repeat for more. The prompt "
        "becomes a chat turn (the images, then --prompt) and the answer ends with its turn",
    )
    gen.add_argument("--requests", type=pathlib.Path, default=None, help="JSON lines of requests")
    gen.add_argument("--out", type=pathlib.Path, default=None, help="JSON lines of results, in input order")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="--prompt: tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="--prompt: temperature; 0 (default): greedy")
    gen.add_argument("--seed", type=int, default=0, help="--prompt: sampling seed (default 0)")
    gen.add_argument("--json", action="store_true", help="--prompt: print JSON (prompt, completion, token ids)")
    gen.add_argument("--cache-gb", type=float, default=1.0, help="device memory for the KV pages and KDA slots")
    gen.add_argument("--page-size", type=int, default=16, help="positions per cache page (default 16)")
    gen.add_argument("--max-seqs", type=int, default=16, help="most sequences decoding at once (default 16)")
    gen.add_argument("--step-tokens", type=int, default=256, help="token budget of one engine step (default 256)")
    gen.add_argument("--chunk-size", type=int, default=128, help="most prompt tokens of a sequence per step")
    gen.add_argument(
        "--mesh",
        default=None,
        help="shard the weights over a mesh of all devices, e.g. tensor=4,expert=2 (axes data, fsdp, expert, "
        "context, tensor; default: one device)",
    )
    _add_distributed_flags(gen)
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    gen.set_defaults(fn=_cmd_generate)
    return gen


def _cmd_serve(args) -> int:
    from jaxmoe.serve.cli import serve  # noqa: PLC0415

    return serve(args)


def _add_serve(sub) -> argparse.ArgumentParser:
    from jaxmoe.serve.cli import add_arguments  # noqa: PLC0415

    srv = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server over the inference engine",
        description="Serves a training workdir or model checkpoint: GET /v1/models, POST /v1/chat/completions, "
        "/v1/completions, /v1/messages, /v1/messages/count_tokens, GET /metrics, /health.",
    )
    add_arguments(srv)
    srv.set_defaults(fn=_cmd_serve, parser=srv)
    return srv


def _cmd_agent(args) -> int:
    from jaxmoe.agent.cli import run  # noqa: PLC0415

    return run(args)


def _add_agent(sub) -> None:
    from jaxmoe.agent.cli import add_arguments  # noqa: PLC0415

    agent = sub.add_parser(
        "agent",
        help="run a task against an OpenAI-compatible endpoint with sandboxed file and shell tools",
        description="An AgentSession over --base-url: the whole history kept, tool calls validated and run, "
        "retries with backoff; the final answer on stdout.",
    )
    add_arguments(agent)
    agent.set_defaults(fn=_cmd_agent, parser=agent)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="parameter counts and memory facts of a config, as one JSON line")
    info.add_argument("--config", required=True, type=pathlib.Path, help="ml_collections config file")
    info.set_defaults(fn=_cmd_info)

    logits = sub.add_parser("logits", help="float32 logits [B, T, V] of int token ids [B, T]")
    logits.add_argument("--checkpoint", required=True, help="jaxmoe checkpoint directory: local or gs://B/P")
    logits.add_argument("--tokens", required=True, type=pathlib.Path, help="int32 .npy file [B, T]")
    logits.add_argument("--out", required=True, type=pathlib.Path, help="output .npy file")
    logits.add_argument(
        "--pixel-values",
        type=pathlib.Path,
        help="float32 .npy [patches, 3, patch, patch] (HF pixel_values): the images at the tokens' placeholders",
    )
    logits.add_argument(
        "--image-grid", type=pathlib.Path, help="int .npy [images, 3] (HF image_grid_thw: t, h, w in patches)"
    )
    logits.set_defaults(fn=_cmd_logits)

    _add_convert(sub)
    train = _add_train(sub)
    _add_compile(sub)
    gen = _add_generate(sub)
    _add_serve(sub)
    _add_agent(sub)
    rl = _add_rl(sub)
    for sp in (train, gen, rl):
        sp.set_defaults(parser=sp)
    return p


def main(argv: list[str] | None = None) -> int:
    from jaxmoe.train.overrides import OverrideError, split_overrides  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        overrides, argv = split_overrides(argv)
    except OverrideError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if overrides and args.command not in ("train", "compile", "rl"):
        parser.error(f"--config.KEY=VALUE flags belong to train, compile and rl, not {args.command}: {overrides[0][0]}")
    args.overrides = overrides
    try:
        return args.fn(args)
    except OverrideError as e:
        print(f"jaxmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"jaxmoe {args.command}: error: {e}", file=sys.stderr)
        return 1
