"""The ``jaxmoe`` command line: ``info``, ``convert hf|quantize|dequantize``, ``logits``.

Every subcommand has ``--help``. Bad arguments exit with status 2 and a message naming the
argument; bad configs and checkpoints exit with status 1 and a message naming the field or tensor.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from jaxmoe.checkpoint.hf_common import CheckpointError
from jaxmoe.config import ConfigError


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
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    logits = np.asarray(forward(state, tokens.astype(np.int32)), dtype=np.float32)
    np.save(args.out, logits)
    print(json.dumps({"out": str(args.out), "shape": list(logits.shape)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="parameter counts and memory facts of a config, as one JSON line")
    info.add_argument("--config", required=True, type=pathlib.Path, help="ml_collections config file")
    info.set_defaults(fn=_cmd_info)

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

    logits = sub.add_parser("logits", help="float32 logits [B, T, V] of int token ids [B, T]")
    logits.add_argument("--checkpoint", required=True, type=pathlib.Path, help="jaxmoe checkpoint directory")
    logits.add_argument("--tokens", required=True, type=pathlib.Path, help="int32 .npy file [B, T]")
    logits.add_argument("--out", required=True, type=pathlib.Path, help="output .npy file")
    logits.set_defaults(fn=_cmd_logits)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"jaxmoe {args.command}: error: {e}", file=sys.stderr)
        return 1
