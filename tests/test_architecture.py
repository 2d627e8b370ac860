"""The shape of the code: layers import one way, no import cycles, the algebra stands alone, light imports.

Imports are read from the source (``ast``), function-level ones included, and resolved to project modules;
the import graph is a ``networkx.DiGraph``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("regiontrace", "loader")
MAX_LINES = 500  # "modules under ~450 lines", with a little slack

#: the loader's layers, bottom first: a module may import its own layer and the layers below only
LOADER_LAYERS = (
    ("_torch",),  # torch's private names, imports nothing of the project
    ("errors",),
    ("checkpoint",),
    ("rules",),
    ("plan",),
    ("placements",),
    ("execute",),
    ("distributed",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import, modules: set[str]) -> set[str]:
    """Project modules an import statement loads (``from pkg import sub`` loads ``pkg.sub`` when it is one)."""
    if isinstance(node, ast.Import):
        bases = [a.name for a in node.names]
        return {_longest(b, modules) for b in bases} - {None}
    if node.level:
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    found = {_longest(base, modules)} - {None}
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.add(sub)
    return found


def _longest(name: str, modules: set[str]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> nx.DiGraph:
    modules = project_modules()
    names = set(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, is_package, node, names):
                    if target != name and not name.startswith(target + "."):  # a package's own __init__
                        graph.add_edge(name, target, line=node.lineno)
    return graph


GRAPH = import_graph()


def test_the_graph_sees_function_level_imports():
    assert GRAPH.has_edge("loader.api", "loader.distributed") or GRAPH.has_edge("loader.api", "loader.execute")
    assert GRAPH.has_edge("regiontrace", "regiontrace.symbolic")  # inside __getattr__


def test_no_import_cycles():
    cycles = [c for c in nx.simple_cycles(GRAPH) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_algebra_does_not_import_the_loader():
    bad = [(a, b) for a, b in GRAPH.edges if a.startswith("regiontrace") and b.startswith("loader")]
    assert not bad, bad


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, names in enumerate(LOADER_LAYERS):
        if parts[1] in names:
            return i
    return len(LOADER_LAYERS)  # api, planner, reader, simulate, save, cli: the top, which only composes


def test_loader_layers_import_downwards():
    bad = []
    for a, b in GRAPH.edges:
        if a.startswith("loader.") and b.startswith("loader."):
            la, lb = _layer(a), _layer(b)
            if la is not None and lb is not None and lb > la:
                bad.append(f"{a} (layer {la}) imports {b} (layer {lb}), line {GRAPH.edges[a, b]['line']}")
    assert not bad, "\n".join(bad)


def test_modules_stay_small():
    big = {name: n for name, p in project_modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


@pytest.mark.parametrize(
    ("code", "forbidden"),
    [
        ("import regiontrace", ("sympy", "networkx", "hypothesis", "loader")),
        # torch.distributed.tensor itself imports sympy; loader must add neither networkx nor hypothesis
        ("import torch.distributed.tensor, loader", ("networkx", "hypothesis", "regiontrace.symbolic")),
    ],
)
def test_light_imports(code, forbidden):
    check = f"{code}; import sys; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
