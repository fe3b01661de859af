"""``jaxmoe serve`` flags, their checks, and the uvicorn run."""

from __future__ import annotations

import argparse
import logging
import sys

from jaxmoe.serve.tiers import DEFAULT_BUDGETS, DEFAULT_SLOTS, parse_tier_values


def _budgets_help() -> str:
    return ",".join(f"{t}={n}" for t, n in DEFAULT_BUDGETS.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="training workdir (e.g. runs/tiny), its checkpoints/ root, or a model "
        "checkpoint (config.json + params/) with a tokenizer.json; local or gs://",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-keys", default=None, help="file of API keys, one a line, # comments (also JAXMOE_API_KEYS)")
    p.add_argument("--model-name", default=None, help="the served model id (default: the checkpoint's config name)")
    p.add_argument("--thinking-budgets", default=None, help=f"thinking tokens per tier (default {_budgets_help()})")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests per tier before 429 (default 64)")
    p.add_argument(
        "--tier-slots",
        default=None,
        help="requests running at once per tier (default "
        + ",".join(f"{t}={n}" for t, n in DEFAULT_SLOTS.items())
        + ")",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM); with --ssl-keyfile")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    p.add_argument(
        "--cache-gb", type=float, default=1.0, help="device memory for the KV pages and KDA slots, GB (default 1)"
    )
    p.add_argument("--page-size", type=int, default=16, help="positions per cache page (default 16)")
    p.add_argument("--step-tokens", type=int, default=256, help="token budget of one engine step (default 256)")
    p.add_argument(
        "--chunk-size", type=int, default=128, help="most prompt tokens of a sequence per step (default 128)"
    )
    p.add_argument(
        "--warmup-context",
        type=int,
        default=8192,
        help="positions up to which the engine compiles covers of every step shape at start, in the "
        "background, so that no request waits for a compile (0: none; default 8192)",
    )
    from jaxmoe.vision.preprocess import ImageLimits  # noqa: PLC0415 (jax behind it: keep --help fast)

    limits = ImageLimits()
    p.add_argument(
        "--max-images",
        type=int,
        default=limits.max_images,
        help=f"images in one request (a model with a vision tower; default {limits.max_images})",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=limits.max_bytes,
        help=f"encoded bytes of one image (default {limits.max_bytes})",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.max_pixels,
        help=f"width x height of one image before resizing (default {limits.max_pixels})",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from_args(args):
    """A :class:`ServeConfig` from the flags; ``parser.error`` (exit 2) naming the flag on bad values."""
    from jaxmoe.serve.app import ServeConfig  # noqa: PLC0415
    from jaxmoe.serve.auth import load_api_keys  # noqa: PLC0415
    from jaxmoe.vision.preprocess import ImageLimits  # noqa: PLC0415

    error = args.parser.error
    for flag in ("max_queue", "page_size", "step_tokens", "chunk_size", "warmup_context"):
        least = 0 if flag in ("max_queue", "warmup_context") else 1
        if getattr(args, flag) < least:
            error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if not 0 <= args.port < 65536:
        error(f"--port must be in [0, 65536), got {args.port}")
    if not args.cache_gb > 0:
        error(f"--cache-gb must be > 0, got {args.cache_gb}")
    if not args.request_timeout > 0:
        error(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        error("--ssl-certfile and --ssl-keyfile go together")
    for flag in ("max_images", "max_image_bytes", "max_image_pixels"):
        if getattr(args, flag) < 1:
            error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    image_limits = ImageLimits(
        max_images=args.max_images, max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels
    )
    try:
        budgets = parse_tier_values(args.thinking_budgets, "--thinking-budgets")
        slots = parse_tier_values(args.tier_slots, "--tier-slots")
        keys = load_api_keys(args.api_keys)
    except ValueError as e:
        error(str(e))
    return ServeConfig(
        model_name=args.model_name,
        api_keys=keys,
        budgets=budgets,
        slots=slots,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        cache_bytes=int(args.cache_gb * 2**30),
        page_size=args.page_size,
        step_tokens=args.step_tokens,
        chunk_size=args.chunk_size,
        warmup_context=args.warmup_context,
        image_limits=image_limits,
    )


def serve(args) -> int:
    import uvicorn  # noqa: PLC0415

    from jaxmoe.serve.app import build_service, create_app  # noqa: PLC0415

    config = config_from_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxmoe").setLevel(args.log_level.upper())
    try:
        service = build_service(args.checkpoint, config)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxmoe serve: error: {e}", file=sys.stderr)
        return 1
    uvicorn.run(
        create_app(service),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        timeout_graceful_shutdown=5,
    )
    return 0
