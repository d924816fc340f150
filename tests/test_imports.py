"""The rooms of the house: no import circle, and imports run from higher layers to lower ones only.

The graph is read from the source with ``ast``, so it counts what running the code would not show at once:
imports inside functions and under ``if TYPE_CHECKING:``. A relative import is resolved against its module's
package, and ``from package import module`` is an edge to the module. The lazy name tables of the packages'
``__init__`` (``_WHERE``) are strings, not imports: importing a package runs none of them.

Run as a script (``python tests/test_imports.py [checkout]``) it prints what it finds.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec_cli", "specdec_plugins")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # (layer, the modules in it: a name covers its submodules); highest first
    ("entry points and public re-exports", ("specdec_cli.<root module>",)),
    ("the CLI", ("specdec_cli.commands",)),
    (
        "applications and the author's kit",
        ("specdec_cli.generation", "specdec_cli.bench", "specdec_cli.acceptance", "specdec_cli.kit"),
    ),
    ("built-in plugins", ("specdec_plugins",)),
    ("engine", ("specdec_cli.engine",)),
    (
        "plugin registry",
        (
            "specdec_cli.plugins.registry",
            "specdec_cli.plugins.plugin_registry",
            "specdec_cli.plugins.verifier_registry",
            "specdec_cli.plugins.drafter_registry",
            "specdec_cli.plugins.discovery",
            "specdec_cli.plugins.descriptions",
            "specdec_cli.plugins.sweeps",
        ),
    ),
    ("plugin contracts", ("specdec_cli.plugins",)),
    ("models", ("specdec_cli.models",)),
    ("results", ("specdec_cli.results",)),
    # The package itself imports nothing when imported (its names load on first use), so any module may read
    # __version__ from it.
    ("base", ("specdec_cli.base", "specdec_cli.recipes", "specdec_cli")),
]
"""A module imports from its own layer or a lower one."""
SIDE_BY_SIDE = {"applications and the author's kit"}
"""Layers whose folders stand side by side: a folder there imports from no other folder of its layer."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    return found


def import_graph(found: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {imported module of the packages: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, file in found.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str, line: int, name: str = name, edges: dict[str, int] = edges) -> None:
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)

        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    add(submodule if submodule in found else module, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str, found: dict[str, Path]) -> tuple[int, str]:
    """(the module's layer, 0 the highest; the folder or name that put it there)."""
    parts = module.split(".")
    if parts[0] == "specdec_cli" and len(parts) == 2 and found[module].parent.name == "specdec_cli":
        if found[module].name != "__init__.py":
            return 0, module
    best = None
    for number, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (number, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS in {Path(__file__).name}")
    return best


def problems(root: Path = ROOT) -> list[str]:
    found = modules(root)
    graph = import_graph(found)
    out = []
    for component in cycles(graph):
        out.append("import circle: " + ", ".join(component))
        for a in component:
            for b, line in sorted(graph[a].items()):
                if b in component:
                    out.append(f"    {a} -> {b}  ({found[a].relative_to(root)}:{line})")
    for a in sorted(graph):
        here, room = layer(a, found)
        for b, line in sorted(graph[a].items()):
            there, other = layer(b, found)
            upward = there < here
            sideways = there == here and room != other and LAYERS[here][0] in SIDE_BY_SIDE
            if upward or sideways:
                out.append(
                    f"{'upward' if upward else 'sideways'} import: {a} ({LAYERS[here][0]}) -> {b} "
                    f"({LAYERS[there][0]})  ({found[a].relative_to(root)}:{line})"
                )
    return out


def test_every_module_is_in_a_layer():
    found = modules()
    for module in found:
        layer(module, found)


def test_no_import_circle_and_imports_run_downward_only():
    found = problems()
    assert not found, "\n" + "\n".join(found)


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path):
    package = tmp_path / "specdec_cli"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (tmp_path / "specdec_plugins").mkdir()
    graph = import_graph(modules(tmp_path))
    assert graph["specdec_cli.a"] == {"specdec_cli.sub.b": 3}
    assert graph["specdec_cli.sub.b"] == {"specdec_cli.a": 2}
    assert cycles(graph) == [["specdec_cli.a", "specdec_cli.sub.b"]]


def test_the_root_holds_at_most_15_modules():
    root = sorted(p.name for p in (ROOT / "specdec_cli").glob("*.py"))
    assert len(root) <= 15, root


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    print("\n".join(found))
    sys.exit(1 if found else 0)


MODULE_LINES, FUNCTION_LINES = 500, 60
"""The house's sizes: a module a reader holds in mind, a function read in one screen."""


def oversized(root: Path = ROOT) -> list[str]:
    """The modules over :data:`MODULE_LINES` lines and the functions over :data:`FUNCTION_LINES` (a function's
    lines from its ``def`` to its last, docstring included), as ``path: what``."""
    found = []
    for path in modules(root).values():
        text = path.read_text()
        where = path.relative_to(root)
        if text.count("\n") > MODULE_LINES:
            found.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno}: {node.name} is {length} lines")
    return found


def test_no_module_over_500_lines_and_no_function_over_60():
    found = oversized()
    assert not found, "\n" + "\n".join(found)


def test_the_size_check_finds_a_long_module_and_a_long_function(tmp_path):
    package = tmp_path / "specdec_cli"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (package / "long.py").write_text("def long():\n" + body + "\n" * MODULE_LINES)
    (tmp_path / "specdec_plugins").mkdir()
    assert oversized(tmp_path) == [
        f"specdec_cli/long.py: {FUNCTION_LINES + 1 + MODULE_LINES} lines",
        f"specdec_cli/long.py:1: long is {FUNCTION_LINES + 1} lines",
    ]
