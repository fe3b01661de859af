"""Agent tools: schemas from hints and docstrings, jsonschema validation, concurrent runs, the sandbox."""

import json
import os
import threading
import time
from typing import Literal

import jsonschema
import pytest

from jaxmoe.agent import Tool, tool_from_function
from jaxmoe.agent.sandbox import SandboxError, file_tools, resolve, shell_tool
from jaxmoe.agent.tools import checked_arguments, run_calls


def lookup(city: str, days: int, unit: Literal["c", "f"] = "c", tags: list[str] | None = None) -> dict:
    """Look up the weather of a city.

    A second paragraph the model does not need.

    Args:
        city: the city's name.
        days: how many days ahead,
            counted from today.
        unit: the temperature unit.
    """
    return {"city": city, "days": days, "unit": unit, "tags": tags}


def test_schema_from_hints_and_docstring():
    tool = tool_from_function(lookup)
    assert tool.name == "lookup"
    assert tool.description == "Look up the weather of a city."
    p = tool.parameters
    assert p["required"] == ["city", "days"]
    assert p["additionalProperties"] is False
    assert p["properties"]["city"] == {"type": "string", "description": "the city's name."}
    assert p["properties"]["days"]["description"] == "how many days ahead, counted from today."
    assert p["properties"]["unit"] == {"enum": ["c", "f"], "description": "the temperature unit.", "default": "c"}
    assert p["properties"]["tags"]["anyOf"] == [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]
    jsonschema.Draft202012Validator.check_schema(p)
    assert tool.spec()["function"]["parameters"] is p


def test_functions_without_schemas_are_refused():
    def untyped(x):
        return x

    def star(*args: int):
        return args

    def obj(x: object):
        return x

    with pytest.raises(TypeError, match="'x': needs a type hint"):
        tool_from_function(untyped)
    with pytest.raises(TypeError, match="only named parameters"):
        tool_from_function(star)
    with pytest.raises(TypeError, match="'x': type .* has no JSON schema"):
        tool_from_function(obj)
    with pytest.raises(ValueError, match="Tool.name"):
        Tool("bad name", "", {"type": "object"}, print)
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        Tool("t", "", {"type": "object", "properties": {"a": {"type": "nope"}}}, print)


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"city": "Oslo"}', "'days' is a required property"),
        ('{"city": "Oslo", "days": "two"}', "at days: 'two' is not of type 'integer'"),
        ('{"city": "Oslo", "days": 2, "unit": "k"}', "at unit: 'k' is not one of"),
        ('{"city": "Oslo", "days": 2, "extra": 1}', "Additional properties are not allowed"),
    ],
)
def test_bad_arguments_never_reach_the_tool(arguments, problem):
    called = []
    tool = Tool("t", "", tool_from_function(lookup).parameters, lambda **kw: called.append(kw))
    args, error = checked_arguments(tool, arguments)
    assert args is None and problem in error
    [result] = run_calls({"t": tool}, [("t", arguments)], limit=1, timeout=5)
    assert result.status == "error" and problem in result.content
    assert called == []


def test_calls_run_concurrently_up_to_the_limit_and_come_back_in_call_order():
    lock, live, peak = threading.Lock(), [0], [0]

    def nap(seconds: float, tag: str) -> str:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(seconds)
        with lock:
            live[0] -= 1
        return tag

    tools = {"nap": tool_from_function(nap)}
    calls = [("nap", json.dumps({"seconds": s, "tag": str(i)})) for i, s in enumerate([0.4, 0.1, 0.3, 0.05, 0.2])]
    start = time.monotonic()
    results = run_calls(tools, calls, limit=2, timeout=10)
    assert [r.content for r in results] == ["0", "1", "2", "3", "4"]
    assert peak[0] == 2
    assert time.monotonic() - start < 0.4 + 0.1 + 0.3 + 0.05 + 0.2


def test_exceptions_timeouts_and_unknown_tools_become_results():
    release = threading.Event()

    def boom(x: int) -> int:
        raise KeyError(x)

    def hang() -> str:
        release.wait(30)
        return "late"

    tools = {t.name: t for t in map(tool_from_function, (boom, hang))}
    start = time.monotonic()
    results = run_calls(tools, [("hang", "{}"), ("boom", '{"x": 3}'), ("nope", "{}")], limit=3, timeout=0.3)
    elapsed = time.monotonic() - start
    release.set()
    assert elapsed < 5  # the hanging call was abandoned at its timeout, not waited for
    assert results[0].status == "timeout" and "hang timed out after 0.3 s" in results[0].content
    assert results[1].status == "error" and results[1].content == "error: boom raised KeyError: 3"
    assert results[2].status == "error" and "no tool named 'nope'" in results[2].content
    assert "boom, hang" in results[2].content


# ----------------------------------------------------------------------------------------
# The sandbox


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n    return 42\n")
    (root / "notes.txt").write_text("hello\nworld\n")
    (tmp_path / "secret.txt").write_text("the outside")
    (root / "out_link").symlink_to(tmp_path / "secret.txt")
    (root / "in_link").symlink_to(root / "notes.txt")
    (root / "dir_link").symlink_to(tmp_path)
    return root


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../secret.txt", "'..' is refused"),
        ("pkg/../../secret.txt", "'..' is refused"),
        ("/etc/passwd", "absolute paths are refused"),
        ("~/x", "absolute paths are refused"),
        ("out_link", "symbolic link"),
        ("in_link", "symbolic link"),
        ("dir_link/secret.txt", "symbolic link"),
    ],
)
def test_path_escapes_are_refused(tree, path, why):
    with pytest.raises(SandboxError, match=why):
        resolve(tree.resolve(), path)
    read = {t.name: t for t in file_tools(tree)}["read_file"]
    [result] = run_calls({"read_file": read}, [("read_file", json.dumps({"path": path}))], limit=1, timeout=5)
    assert result.status == "error" and "SandboxError" in result.content and "the outside" not in result.content


def test_file_tools_read_list_and_search_inside_the_root(tree):
    tools = {t.name: t for t in file_tools(tree)}
    assert tools["read_file"].fn(path="pkg/mod.py") == "def f():\n    return 42\n"
    assert (
        tools["read_file"].fn(path="notes.txt", offset=6, max_bytes=3)
        == "wor\n[bytes 6-9 of 12; read on with offset=9]"
    )
    listing = tools["list_files"].fn(path=".").splitlines()
    assert "dir\tpkg" in listing and "file\tnotes.txt\t12" in listing and "link\tout_link" in listing
    assert tools["search_files"].fn(pattern="return") == "pkg/mod.py:2:     return 42"
    assert tools["search_files"].fn(pattern="the outside") == "(no match)"  # links are not followed
    assert tools["search_files"].fn(pattern=r"^w\w+d$", regex=True) == "notes.txt:2: world"
    args, error = checked_arguments(tools["read_file"], '{"path": "notes.txt", "max_bytes": 100000000}')
    assert args is None and "max_bytes" in error


def test_shell_runs_in_the_root_without_secrets(tree, monkeypatch):
    monkeypatch.setenv("JAXMOE_TEST_SECRET", "sk-do-not-leak")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-do-not-leak-either")
    out = shell_tool(tree, timeout=10).fn(command="pwd; env; cat notes.txt; exit 3")
    assert str(tree.resolve()) in out and "hello\nworld" in out
    assert "sk-do-not-leak" not in out and "OPENAI_API_KEY" not in out
    assert out.endswith("[exit status 3]")


def test_shell_timeout_kills_the_process_group(tree):
    pidfile = tree / "child.pid"
    start = time.monotonic()
    out = shell_tool(tree, timeout=1).fn(command=f"sleep 60 & echo $! > {pidfile}; sleep 60")
    assert time.monotonic() - start < 10
    assert "[killed after 1 s" in out
    child = int(pidfile.read_text())
    for _ in range(50):  # the background child is gone too (reaped by init once killed)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the shell's background child {child} outlived the timeout")
