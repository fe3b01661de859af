"""The modules of ``jaxmoe`` import each other without a cycle.

The graph is read from the source (``ast``, nothing is imported): one node per module, one edge
per import statement anywhere in the file, top-level or inside a function (a function-local import
is how a cycle usually hides). How an import becomes an edge:

- ``import jaxmoe.a.b`` and ``from jaxmoe.a.b import name``: an edge to ``jaxmoe.a.b``;
- ``from jaxmoe.a import b`` where ``jaxmoe/a/b.py`` (or ``b/__init__.py``) exists: an edge to the
  submodule ``jaxmoe.a.b``, not to the package ``jaxmoe.a``; where ``b`` is a name defined in
  ``jaxmoe/a/__init__.py``: an edge to the package ``jaxmoe.a``;
- relative imports are resolved the same way; imports of other packages are not edges.

The parent packages Python runs before any submodule (``jaxmoe.a`` before ``jaxmoe.a.b``) are not
edges: every import of a submodule does that, and a package ``__init__.py`` that imports its
submodules to re-export them would otherwise be a cycle with each of them. A submodule that takes
names from its own package's ``__init__.py`` (``from jaxmoe.a import Name`` inside ``jaxmoe/a/b.py``
with ``jaxmoe/a/__init__.py`` importing ``b``) is a cycle, and is reported. Imports under ``if
TYPE_CHECKING:`` count like any other (the package has none).
"""

import ast
import graphlib
import pathlib
import textwrap

import jaxmoe

PACKAGE = "jaxmoe"


def _module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Dotted name -> source file of every module under ``root`` (the package's directory)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: not in the package)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in modules:
            return prefix
    return None


def import_graph(root: pathlib.Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for the rules)."""
    modules = _module_names(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # A submodule named in the import list is what is imported; otherwise the module itself.
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    graph[module].add(resolved)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]`` (each imports the next), or None."""
    try:
        # TopologicalSorter reads the mapping as node -> predecessors; a cycle is a cycle either way.
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))
    return None


def _format(cycle: list[str]) -> str:
    return " -> ".join(cycle)


def test_jaxmoe_has_no_import_cycle():
    root = pathlib.Path(jaxmoe.__file__).parent
    graph = import_graph(root)
    assert "jaxmoe.config" in graph and "jaxmoe.attention.kda" in graph, sorted(graph)
    assert "jaxmoe.rules" in graph["jaxmoe.config"], "the walk should see config's import of the rules"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {_format(cycle)}"


def test_rules_is_a_leaf():
    """config, sharding and the shard_map regions all read the table: it must import none of them."""
    graph = import_graph(pathlib.Path(jaxmoe.__file__).parent)
    assert graph["jaxmoe.rules"] == set()


def _write_package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_function_local_import_cycle_is_found(tmp_path):
    """The shape of the old ``config`` <-> ``sharding`` cycle: one side imports inside a function."""
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "config.py": """
                def validate():
                    from pkg.sharding import RULES
                    return RULES
            """,
            "sharding.py": "from pkg.config import validate\nRULES = ()\n",
        },
    )
    cycle = find_cycle(import_graph(root, "pkg"))
    assert cycle is not None and set(cycle) == {"pkg.config", "pkg.sharding"}, cycle
    assert cycle[0] == cycle[-1]


def test_package_submodule_edges(tmp_path):
    """``from pkg.sub import mod`` is an edge to the submodule; taking the package's own names is a cycle."""
    files = {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub.a import A\n",
        "sub/a.py": "from pkg.sub import b as b_module\nA = 1\n",
        "sub/b.py": "import math\n",
    }
    graph = import_graph(_write_package(tmp_path, files), "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert graph["pkg.sub.a"] == {"pkg.sub.b"}
    assert find_cycle(graph) is None

    files["sub/b.py"] = "from pkg.sub import A\n"  # a name of the package's __init__, which imports a, which imports b
    cycle = find_cycle(import_graph(_write_package(tmp_path / "again", files), "pkg"))
    assert cycle is not None and set(cycle) == {"pkg.sub", "pkg.sub.a", "pkg.sub.b"}, cycle


def test_relative_imports_resolve(tmp_path):
    files = {
        "__init__.py": "",
        "sub/__init__.py": "from . import a\n",
        "sub/a.py": "from .b import x\nfrom .. import top\n",
        "sub/b.py": "x = 1\n",
        "top.py": "",
    }
    graph = import_graph(_write_package(tmp_path, files), "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert graph["pkg.sub.a"] == {"pkg.sub.b", "pkg.top"}
