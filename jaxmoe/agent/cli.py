"""``jaxmoe agent``: run one task against an OpenAI-compatible endpoint with sandboxed tools.

The final answer goes to stdout; with ``--transcript FILE`` the whole session is saved there as
JSON lines after every run (also when it fails), and ``--resume FILE`` continues a saved one.
Exit status 1 (and the reason on stderr) when the session cannot finish, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

TOOLSETS = ("files", "shell")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key (default OPENAI_API_KEY; unset: no key)",
    )
    p.add_argument("--task", default=None, help="the task (a user message); optional with --resume")
    p.add_argument("--model", default=None, help="model id (default: the first one GET /v1/models lists)")
    p.add_argument("--thinking", default="auto", choices=("auto", "low", "high", "max"), help="thinking tier")
    p.add_argument("--tools", default="", help=f"comma-separated tool sets among {', '.join(TOOLSETS)} (default none)")
    p.add_argument("--root", default=".", help="the directory the file and shell tools work in (default .)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per model request and per tool call")
    p.add_argument("--shell-timeout", type=float, default=60.0, help="seconds a shell command may run (default 60)")
    p.add_argument("--max-turns", type=int, default=32, help="model requests before giving up (default 32)")
    p.add_argument("--max-retries", type=int, default=3, help="retries of a failed request (default 3)")
    p.add_argument("--transcript", type=pathlib.Path, default=None, help="save the session here (JSON lines)")
    p.add_argument("--resume", type=pathlib.Path, default=None, help="continue the session saved in this file")


def _toolsets(args) -> list:
    from jaxmoe.agent.sandbox import file_tools, shell_tool  # noqa: PLC0415

    names = [t.strip() for t in args.tools.split(",") if t.strip()]
    for name in names:
        if name not in TOOLSETS:
            args.parser.error(f"--tools: unknown tool set {name!r}; choose among {', '.join(TOOLSETS)}")
    root = pathlib.Path(args.root)
    if names and not root.is_dir():
        args.parser.error(f"--root {args.root!r}: not a directory")
    tools = file_tools(root) if "files" in names else []
    if "shell" in names:
        tools.append(shell_tool(root, timeout=min(args.shell_timeout, args.timeout)))
    return tools


def _check(args) -> None:
    error = args.parser.error
    if args.task is None and args.resume is None:
        error("--task is required (unless --resume continues a saved session)")
    for flag in ("timeout", "shell_timeout"):
        if not getattr(args, flag) > 0:
            error(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    if args.max_turns < 1:
        error(f"--max-turns must be >= 1, got {args.max_turns}")
    if args.max_retries < 0:
        error(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.resume is not None and not args.resume.is_file():
        error(f"--resume {str(args.resume)!r}: no such file")


def run(args) -> int:
    import openai  # noqa: PLC0415

    from jaxmoe.agent.session import AgentError, AgentSession, detail  # noqa: PLC0415

    _check(args)
    tools = _toolsets(args)
    key = os.environ.get(args.api_key_env) or "none"
    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=0, timeout=args.timeout)
    options = dict(timeout=args.timeout, max_turns=args.max_turns, max_retries=args.max_retries)
    try:
        if args.resume is not None:
            session = AgentSession.resume(args.resume, client, tools, **options)
        else:
            model = args.model or client.models.list().data[0].id
            session = AgentSession(client, tools, model=model, thinking=args.thinking, **options)
    except openai.APIStatusError as e:
        print(f"jaxmoe agent: error: GET {args.base_url}/models: HTTP {e.status_code}: {detail(e)}", file=sys.stderr)
        return 1
    except (ValueError, openai.OpenAIError, IndexError) as e:
        print(f"jaxmoe agent: error: {e}", file=sys.stderr)
        return 1
    try:
        answer = session.run(args.task)
    except AgentError as e:
        print(f"jaxmoe agent: error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.transcript is not None:
            session.save(args.transcript)
    print(answer)
    return 0
