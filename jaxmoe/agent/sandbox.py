"""Sandboxed tools for ``jaxmoe agent``: files under one root, and an opt-in shell.

**Files** (:func:`file_tools`): ``read_file``, ``list_files`` and ``search_files`` see only the tree
under ``root``. A path is relative to the root; absolute paths, ``..`` components and symbolic links
anywhere on the path are refused (a link inside the tree could point anywhere), and the resolved
path must still lie under the root. Listings and searches do not follow links.

**Shell** (:func:`shell_tool`, off unless asked for): ``/bin/sh -c COMMAND`` in a subprocess of its
own session (process group) with the root as working directory, stdin closed, and an environment
built from scratch (``PATH``, ``HOME`` = the root, ``LANG``, ``TERM``): nothing of the agent's
environment, API keys included, is inherited. At the timeout the whole process group is killed
(``SIGKILL``), children and grandchildren too. Output is capped and the cap is said in the result.
This is process-level isolation for a trusted operator's machine, not a container: use the
deployment's sandbox (a pod or VM of its own) for untrusted work.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import stat
import subprocess

from jaxmoe.agent.tools import Tool, tool_from_function

MAX_READ = 64 * 1024
MAX_MATCHES = 200
MAX_SEARCH_FILE = 1 << 20
MAX_OUTPUT = 32 * 1024


class SandboxError(ValueError):
    """A path outside the sandbox, or a request the sandbox does not allow."""


def resolve(root: pathlib.Path, path: str) -> pathlib.Path:
    """``root / path`` after refusing absolute paths, ``..``, symlinks on the way, and escapes."""
    if not isinstance(path, str) or "\x00" in path:
        raise SandboxError(f"path {path!r}: must be a string without NUL bytes")
    rel = pathlib.PurePosixPath(path)
    if rel.is_absolute() or path.startswith("~"):
        raise SandboxError(f"path {path!r}: absolute paths are refused; give a path relative to the root")
    if ".." in rel.parts:
        raise SandboxError(f"path {path!r}: '..' is refused; paths stay under the root")
    current = root
    for part in rel.parts:
        current = current / part
        if current.is_symlink():
            raise SandboxError(f"path {path!r}: {part!r} is a symbolic link; links are not followed")
    resolved = current.resolve()
    if resolved != root and root not in resolved.parents:
        raise SandboxError(f"path {path!r}: resolves outside the root")
    return resolved


def _rel(root: pathlib.Path, p: pathlib.Path) -> str:
    return p.relative_to(root).as_posix() or "."


def file_tools(root) -> list[Tool]:
    """``read_file``, ``list_files`` and ``search_files`` over the tree under ``root``."""
    root = pathlib.Path(root).resolve(strict=True)
    if not root.is_dir():
        raise SandboxError(f"--root {root}: not a directory")

    def read_file(path: str, offset: int = 0, max_bytes: int = MAX_READ) -> str:
        p = resolve(root, path)
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SandboxError(f"path {path!r}: not a regular file")
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            data = f.read(max_bytes)
        text = data.decode("utf-8", errors="replace")
        end = offset + len(data)
        tail = f"\n[bytes {offset}-{end} of {size}; read on with offset={end}]" if end < size or offset else ""
        return text + tail

    def list_files(path: str = ".") -> str:
        p = resolve(root, path)
        if not p.is_dir():
            raise SandboxError(f"path {path!r}: not a directory")
        lines = []
        for child in sorted(p.iterdir()):
            kind = "link" if child.is_symlink() else "dir" if child.is_dir() else "file"
            size = child.lstat().st_size if kind == "file" else ""
            lines.append(f"{kind}\t{_rel(root, child)}\t{size}".rstrip())
        return "\n".join(lines) or "(empty directory)"

    def search_files(pattern: str, path: str = ".", regex: bool = False) -> str:
        p = resolve(root, path)
        compiled = re.compile(pattern if regex else re.escape(pattern))
        hits = []
        for dirpath, dirnames, filenames in os.walk(p, followlinks=False):
            dirnames.sort()
            for name in sorted(filenames):
                f = pathlib.Path(dirpath) / name
                if f.is_symlink() or f.stat().st_size > MAX_SEARCH_FILE:
                    continue
                for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if compiled.search(line):
                        hits.append(f"{_rel(root, f)}:{n}: {line[:200]}")
                        if len(hits) == MAX_MATCHES:
                            return "\n".join(hits) + f"\n[stopped at {MAX_MATCHES} matches]"
        return "\n".join(hits) or "(no match)"

    read_file.__doc__ = f"""Read a text file under the root.

        Args:
            path: the file, relative to the root.
            offset: the first byte to read.
            max_bytes: how many bytes to read (at most {MAX_READ}).
        """
    list_files.__doc__ = """List a directory under the root: kind, path and size of each entry.

        Args:
            path: the directory, relative to the root.
        """
    search_files.__doc__ = f"""Find lines containing a pattern in the files under a directory (at most {MAX_MATCHES}).

        Args:
            pattern: the text to find (a Python regular expression when regex is true).
            path: the directory to search, relative to the root.
            regex: whether pattern is a regular expression.
        """
    tools = [tool_from_function(f) for f in (read_file, list_files, search_files)]
    read = tools[0].parameters["properties"]
    read["offset"]["minimum"] = 0
    read["max_bytes"].update(minimum=1, maximum=MAX_READ)
    return tools


def _capped(data: bytes) -> str:
    text = data[:MAX_OUTPUT].decode("utf-8", errors="replace")
    return text + (f"\n[{len(data) - MAX_OUTPUT} more bytes not shown]" if len(data) > MAX_OUTPUT else "")


def shell_tool(root, *, timeout: float) -> Tool:
    """``shell``: a command in ``/bin/sh`` under ``root``, killed with its process group after ``timeout`` s."""
    root = pathlib.Path(root).resolve(strict=True)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "TERM": "dumb"}

    def shell(command: str) -> str:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return _capped(out) + f"\n[killed after {timeout:g} s: the command and every process it started]"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything it left running in the background
            except ProcessLookupError:
                pass
        return _capped(out) + f"\n[exit status {proc.returncode}]"

    desc = (
        f"Run a shell command (/bin/sh -c) in the root directory, with a {timeout:g} s timeout and no "
        "inherited environment; returns its output and exit status."
    )
    params = {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command line"}},
        "required": ["command"],
        "additionalProperties": False,
    }
    return Tool("shell", desc, params, shell)
