"""Reviewability limits of ``jaxmoe/``: no function over 80 lines, no file over 600 lines."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "jaxmoe"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
SOURCES = sorted(PACKAGE.rglob("*.py"))


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function or method (nested ones too) longer than ``limit`` lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((node.name, n))
    return out


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [("f", 82)]
    assert long_functions("def g():\n    return 1\n", MAX_FUNCTION_LINES) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_function_and_file_length(path):
    source = path.read_text()
    assert long_functions(source, MAX_FUNCTION_LINES) == []
    assert len(source.splitlines()) <= MAX_FILE_LINES
