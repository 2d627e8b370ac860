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
MAX_LINES = 420  # "modules under ~400 lines", with a little slack
MAX_CLASS_LINES = 160  # "a class under ~150 lines", with a little slack

#: the loader's layers, bottom first: a module may import its own layer and the layers below only
LOADER_LAYERS = (
    ("_torch",),  # torch's private names, imports nothing of the project
    ("options",),  # Rules, LoadOptions: the values every layer passes down, imports nothing of the project
    ("errors",),
    ("storage",),  # where bytes come from: local files (preadv) or object stores (ranged requests)
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
    return len(LOADER_LAYERS)  # api, planner, reader, simulate, save, transfer, cli: the top, which only composes


def test_loader_layers_import_downwards():
    bad = []
    for a, b in GRAPH.edges:
        if a.startswith("loader.") and b.startswith("loader."):
            la, lb = _layer(a), _layer(b)
            if la is not None and lb is not None and lb > la:
                bad.append(f"{a} (layer {la}) imports {b} (layer {lb}), line {GRAPH.edges[a, b]['line']}")
    assert not bad, "\n".join(bad)


# -- the algebra's public face ---------------------------------------------------------------------------------------

#: the regiontrace modules the loader may take names from, each only the names in its ``__all__``: the package
#: itself (the algebra), its executor (running blocks on real bytes) and the command line the loader's extends
ALGEBRA_PUBLIC = ("regiontrace", "regiontrace.executor", "regiontrace.cli", "regiontrace.cli.common")
#: the most names the algebra's face (``regiontrace.__all__``) may have: executor helpers go to regiontrace.executor
MAX_ALGEBRA_NAMES = 24  # + destination, coverage (in-place writes and their certificate)


def algebra_uses(source: str) -> list[tuple[int, str, str]]:
    """Each name ``source`` takes from regiontrace, as ``(line, module, name)``.

    A use is ``from regiontrace[.m] import name``; ``import regiontrace.m`` (name ``""``); and the first attribute
    of a chain off a name an import binds to regiontrace or one of its modules (``rt.name.x``: ``name``).
    """
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the regiontrace module it is
    uses: set[tuple[int, str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "regiontrace":
                    if a.name != "regiontrace":
                        uses.add((node.lineno, a.name, ""))
                    bound[a.asname or "regiontrace"] = a.name if a.asname else "regiontrace"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "regiontrace":
            for a in node.names:
                uses.add((node.lineno, node.module, a.name))
                if f"{node.module}.{a.name}" in project_modules():
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            uses.add((node.lineno, bound[node.value.id], node.attr))
    return sorted(uses)


def algebra_violations(source: str) -> list[str]:
    """The uses of :func:`algebra_uses` that are not a public name of a public regiontrace module."""
    import importlib

    bad = []
    for line, module, name in algebra_uses(source):
        public = module in ALGEBRA_PUBLIC and name in getattr(importlib.import_module(module), "__all__", ())
        if not public or name.startswith("_"):
            bad.append(f"line {line}: {module}{'.' + name if name else ''}")
    return bad


@pytest.mark.parametrize(
    ("code", "bad"),
    [
        ("import regiontrace as rt\nb: rt.RemapBlock = rt.RegionTensor.leaf('x', (2,))", 0),
        ("from regiontrace.executor import copy_cast, dest_view\nfrom regiontrace.cli.common import CLIError", 0),
        ("from regiontrace import copy_cast", 1),
        ("import regiontrace\nx = regiontrace.trace", 0),
        ("import regiontrace as rt\nx = rt.values.ValueProgram", 1),
        ("import regiontrace as rt\nx = rt._torch", 1),
        ("import regiontrace\nx = regiontrace.region.contiguous_strides", 1),
        ("from regiontrace.invert import _lattice", 1),
        ("from regiontrace.remap_block import source_span", 1),
        ("from regiontrace import _torch", 1),
        ("from regiontrace.cli.common import _checked_call", 1),
        ("import regiontrace.values as V\nx = V.Apply", 2),
        ("from regiontrace import values\nx = values.leaves", 2),
    ],
)
def test_the_algebra_check_sees_private_uses(code, bad):
    assert len(algebra_violations(code)) == bad, algebra_violations(code)


def test_the_loader_uses_only_the_algebras_public_names():
    bad = [
        f"{path.relative_to(ROOT)} {v}"
        for name, path in project_modules().items()
        if name.startswith("loader")
        for v in algebra_violations(path.read_text())
    ]
    assert not bad, "the loader takes names from regiontrace that are not in a public module's __all__:\n" + "\n".join(
        bad
    )


def test_the_algebras_face_stays_the_algebra():
    """``regiontrace.__all__`` holds the algebra (at most :data:`MAX_ALGEBRA_NAMES` names) and
    ``regiontrace.executor.__all__`` what runs blocks; no name is in both, and docs/algebra.md names every one."""
    import regiontrace
    import regiontrace.executor

    face, executor = regiontrace.__all__, regiontrace.executor.__all__
    assert len(face) <= MAX_ALGEBRA_NAMES, f"regiontrace.__all__ has {len(face)} names (at most {MAX_ALGEBRA_NAMES})"
    assert not set(face) & set(executor), sorted(set(face) & set(executor))
    assert regiontrace.executor.__doc__ and "Vocabulary" in regiontrace.executor.__doc__
    algebra_md = (ROOT / "docs" / "algebra.md").read_text()
    undocumented = [name for name in (*face, *executor) if f"`{name}`" not in algebra_md]
    assert not undocumented, f"not in docs/algebra.md: {undocumented}"
    assert all(hasattr(regiontrace.executor, name) for name in executor)


def test_no_private_name_crosses_a_module():
    """A ``_name`` is its module's own: no project module imports one from another (``from .x import _y``)."""
    bad = []
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
                bad += [f"{name}:{node.lineno} {a.name}" for a in node.names if _private(a.name)]
    assert not bad, bad


def test_modules_stay_small():
    """One idea per module: none over ~400 lines, in the algebra and the loader alike."""
    lines = {name: len(p.read_text().splitlines()) for name, p in project_modules().items()}
    big = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not big, big


def test_classes_stay_small():
    """No class over ~150 lines: cohesive parts move into free functions or small helper classes."""
    big = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, path in project_modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
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


# -- torch's private names -------------------------------------------------------------------------------------------

#: the only modules that may use torch's private names: a torch upgrade touches these two files
TORCH_COMPAT = ("regiontrace._torch", "loader._torch")


def _private(name: str) -> bool:
    """``_name`` is private; dunders (``__version__``, ``__torch_dispatch__``, ``__torch_function__``) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def torch_private_attributes() -> frozenset[str]:
    """The private attribute names of the torch objects the packages handle: tensors, parameters, modules, storages,
    ops and their schemas, DTensor, meshes, placements, dispatch modes (DTensor's ``__slots__`` included)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from loader._torch import StridedShard, TorchDispatchMode

    op = torch.ops.aten.add.Tensor
    tensor = torch.empty(0)
    objects = [tensor, torch.nn.Parameter(tensor), torch.nn.Linear(1, 1), tensor.untyped_storage()]
    objects += [op, torch.ops.aten.add, op._schema, op._schema.arguments[0], torch.device("cpu"), torch.Generator()]
    objects += [DTensor, DeviceMesh, Shard(0), Replicate(), StridedShard(0, split_factor=2), TorchDispatchMode()]
    return frozenset(n for o in objects for n in dir(o) if _private(n))


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when the chain does not start at a name (``f().x``)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def torch_private_uses(source: str, private_attributes: frozenset[str]) -> list[tuple[int, str]]:
    """Each use of a private torch name in ``source``, as ``(line, text)``.

    A use is: an import path under ``torch`` with a private component (``torch.utils._pytree``,
    ``from torch.x import _y``); an attribute chain from a name bound to torch by an import (``torch._C``,
    ``dist.distributed_c10d._get_default_store``, ``DTensor._x``); or, on any object, an attribute or a
    ``getattr``/``hasattr``/``setattr``/``delattr`` string that is a private attribute of torch's objects
    (``func._schema``, ``mod._parameters``, ``getattr(t, "_local_tensor")``). ATen operator names
    (``torch.ops.aten._to_copy``) are operator names, not private Python API, and are not uses.
    """
    tree = ast.parse(source)
    bound: set[str] = set()  # names an import binds to torch or something in it
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound.add(a.asname or "torch")
                    if any(_private(p) for p in a.name.split(".")):
                        found.add((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                bound.add(a.asname or a.name)
                path = [*node.module.split("."), a.name]
                if any(_private(p) for p in path):
                    found.add((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound and chain[:2] != ["torch", "ops"] and any(_private(p) for p in chain[1:]):
                found.add((node.lineno, ".".join(chain)))
            elif node.attr in private_attributes:
                found.add((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private_attributes
        ):
            found.add((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    # a chain's inner attributes are uses of the same name: keep the longest text per line and name
    return sorted(u for u in found if not any(v[0] == u[0] and v[1].startswith(u[1] + ".") for v in found))


@pytest.mark.parametrize(
    ("code", "uses"),
    [
        ("import torch.utils._pytree as pytree", ["import torch.utils._pytree"]),
        ("from torch.distributed.tensor.placement_types import _StridedShard", ["from torch.distributed.tensor"]),
        ("from torch.utils._python_dispatch import TorchDispatchMode", ["from torch.utils._python_dispatch"]),
        ("import torch\nx = torch._C._disabled_torch_function_impl", ["torch._C._disabled_torch_function_impl"]),
        ("import torch.distributed as dist\ns = dist.distributed_c10d._get_default_store()", ["dist.distributed_c10d"]),
        ("from torch.distributed.device_mesh import DeviceMesh\nDeviceMesh._anything", ["DeviceMesh._anything"]),
        ("def f(func):\n    return func._schema.arguments", ["func._schema"]),
        ("def f(mod):\n    return mod._parameters, t._version", ["mod._parameters", "t._version"]),
        ("def f(t):\n    return getattr(t, '_local_tensor', None)", ["getattr(..., '_local_tensor')"]),
        ("import torch\nf = torch.ops.aten._to_copy.default", []),
        ("import torch\naten = torch.ops.aten\nf = aten._unsafe_view", []),
        ("import torch\nv = torch.__version__\nclass T:\n    __torch_function__ = None", []),
        ("class R:\n    def f(self):\n        return self._meta, self._value, _helper()", []),
        ("from ._torch import local_tensor\nfrom torch import nn\nx = nn.Linear", []),
    ],
)
def test_the_torch_private_check_sees_them(code, uses):
    found = [text for _, text in torch_private_uses(code, torch_private_attributes())]
    assert len(found) == len(uses) and all(f.startswith(u) for f, u in zip(found, uses)), found


def test_torch_private_names_only_in_the_compatibility_modules():
    private_attributes = torch_private_attributes()
    assert {"_local_tensor", "_schema", "_parameters", "_get_root_mesh", "_version"} <= private_attributes
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for name, path in project_modules().items()
        if name not in TORCH_COMPAT
        for line, text in torch_private_uses(path.read_text(), private_attributes)
    ]
    assert not bad, "torch's private names belong in regiontrace/_torch.py or loader/_torch.py:\n" + "\n".join(bad)


# -- signatures ------------------------------------------------------------------------------------------------------

MAX_PARAMETERS = (
    8  # more settings than this travel as one value (loader.options: Rules, LoadOptions, StorageOptions...)
)

#: records the library builds and returns (reports, figures, plans, blocks): their fields are what a call found, not
#: settings a caller passes; exempt from MAX_PARAMETERS (docs/design.md, "Options")
RETURNED_RECORDS = {
    "regiontrace.remap_block.RemapBlock",  # a compiled block: built by the tracer, read by the executor
    "regiontrace.remap_block.ReadLayout",  # a block's read layout, derived from a RemapBlock
    "loader.cli.geometry.PlanView",  # what the CLI draws, built from a plan
    "loader.plan.rank.RankPlan",  # a rank's plan, returned by HFLoadPlanner.build_plan
    "loader.report.LoadReport",  # returned by load_hf_checkpoint
    "loader.rules.conversion.Conversion",  # one conversion of a key plan, built by plan_keys
    "loader.rules.keyplan.KeyPlan",  # returned by plan_keys
    "loader.save.api.SaveReport",  # returned by save_hf_checkpoint
    "loader.simulate.RankFigures",  # returned by simulate_load
    "loader.transfer.simulate.TransferFigures",  # returned by simulate_transfer
}


def _public_functions(tree: ast.Module):
    """The public functions of a module, the public methods of its public classes and their ``__init__``."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _private(node.name):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not _private(node.name):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    not _private(item.name) or item.name == "__init__"
                ):
                    yield f"{node.name}.{item.name}", item


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Every parameter of ``fn``: positional-only, positional, keyword-only, ``*args``, ``**kwargs`` (not ``self``,
    ``cls``)."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    return names + ([f"**{a.kwarg.arg}"] if a.kwarg else [])


def _init_fields(node: ast.ClassDef) -> list[str] | None:
    """A dataclass's (or NamedTuple's) ``__init__`` fields (not ``ClassVar``s, not ``field(init=False)``); None for
    another class."""
    record = any("dataclass" in ast.unparse(d) for d in node.decorator_list) or any(
        ast.unparse(b).endswith("NamedTuple") for b in node.bases
    )
    if not record:
        return None
    return [
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s.annotation)
        and not (s.value is not None and "init=False" in ast.unparse(s.value))
    ]


def _too_many_parameters(name: str, tree: ast.Module) -> list[str]:
    bad = []
    for qualname, fn in _public_functions(tree):
        params = _parameters(fn)
        exempt = f"{name}.{qualname.split('.')[0]}" in RETURNED_RECORDS
        if len(params) > MAX_PARAMETERS and not exempt:
            bad.append(f"{name}.{qualname}: {len(params)} ({', '.join(params)})")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not _private(node.name):
            fields = _init_fields(node)
            if fields is not None and len(fields) > MAX_PARAMETERS and f"{name}.{node.name}" not in RETURNED_RECORDS:
                bad.append(f"{name}.{node.name} (fields): {len(fields)} ({', '.join(fields)})")
    return bad


def test_the_parameter_count_sees_every_kind():
    """The count takes keyword-only parameters, ``*args`` and ``**kwargs`` (not ``self``), and a dataclass's fields."""
    code = (
        "def f(a, /, b, *c, d, e=1, **f): ...\n"
        "class C:\n    def __init__(self, a, *, b, c, d, e, f, g, h, **i): ...\n"
        "@dataclass\nclass D:\n" + "".join(f"    x{i}: int = 0\n" for i in range(9))
    )
    tree = ast.parse(code)
    assert [(q, len(_parameters(fn))) for q, fn in _public_functions(tree)] == [("f", 6), ("C.__init__", 9)]
    assert _too_many_parameters("m", tree) == [
        "m.C.__init__: 9 (a, b, c, d, e, f, g, h, **i)",
        "m.D (fields): 9 (x0, x1, x2, x3, x4, x5, x6, x7, x8)",
    ]


def test_no_public_function_or_class_takes_more_than_eight_parameters():
    """A public function, method or class (its ``__init__``; a dataclass's fields) of the loader and the algebra
    takes at most 8 parameters of all kinds: settings travel as one value (:mod:`loader.options`); only the records
    the library returns (:data:`RETURNED_RECORDS`) have more fields."""
    bad = []
    for name, path in project_modules().items():
        if any(_private(part) for part in name.split(".")):
            continue
        bad += _too_many_parameters(name, ast.parse(path.read_text()))
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------
# storage capabilities are declared and checked in one module; the save writes through the storage

CAPABILITIES_MODULE = "loader.storage.capabilities"


def capability_names() -> frozenset[str]:
    """The attribute names of every declared storage capability (its methods and flags)."""
    from loader.storage import capabilities

    return frozenset().union(*(capabilities.members(kind) for kind in capabilities.CAPABILITIES))


def capability_probes(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` whose name is a capability's."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        arg = node.args[1]
        if node.func.id in ("getattr", "hasattr") and isinstance(arg, ast.Constant) and arg.value in names:
            found.append((node.lineno, arg.value))
    return found


@pytest.mark.parametrize(
    ("code", "probes"),
    [
        ('if getattr(reader, "read_ahead", None) is not None: pass', [(1, "read_ahead")]),
        ('scatter = hasattr(r, "read_runs_to")', [(1, "read_runs_to")]),
        ('x = 1\nflag = bool(getattr(store, "remote", False))', [(2, "remote")]),
        (
            'getattr(backend, "multi_range", False) or getattr(store, "probed", None)',
            [(1, "multi_range"), (1, "probed")],
        ),
        ('bounce = getattr(self._local, "bounce", None)', []),  # not a capability
        ("has(reader, ReadsAhead)", []),
    ],
)
def test_the_capability_check_sees_probes(code, probes):
    assert capability_probes(code, capability_names()) == probes


def test_storage_capabilities_are_probed_only_where_they_are_declared():
    """No module but :mod:`loader.storage.capabilities` asks a storage object with ``getattr``/``hasattr`` whether
    it can do something a capability declares (``read_ahead``, ``read_runs_to``, ``cached``, ``remote``, ...):
    they ask the capabilities module (``capability(reader, ReadsAhead)``)."""
    names = capability_names()
    assert {"read_ahead", "read_runs_to", "cached", "remote", "probed", "direct_reader", "stage"} <= names
    bad = {
        name: found
        for name, path in project_modules().items()
        if name.startswith("loader.") and name != CAPABILITIES_MODULE
        for found in [capability_probes(path.read_text(), names)]
        if found
    }
    assert not bad, bad


#: the file system calls the save leaves to the storage's write side (``os.``, ``tempfile.``, ``shutil.``, ``open``)
FILE_CALLS = {
    "os": {"open", "write", "pwrite", "pwritev", "rename", "renames", "replace", "fsync", "fdatasync", "unlink",
           "remove", "rmdir", "removedirs", "mkdir", "makedirs", "link", "symlink", "ftruncate", "truncate",
           "posix_fallocate", "close", "chmod", "umask", "listdir", "scandir", "stat", "lstat", "fstat", "utime"},
    "os.path": {"exists", "lexists", "isdir", "isfile", "islink", "getsize", "realpath"},
    "tempfile": None,  # any
    "shutil": None,
}  # fmt: skip
SAVE_PACKAGE = ROOT / "loader" / "save"


def file_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of every file system call: ``os.X``, ``os.path.X``, ``tempfile.X``, ``shutil.X`` of
    :data:`FILE_CALLS`, and the builtin ``open``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        chain = _chain(node.func)
        if chain == ["open"]:
            found.append((node.lineno, "open"))
        elif chain and len(chain) >= 2:
            module, attr = ".".join(chain[:-1]), chain[-1]
            if module in FILE_CALLS and (FILE_CALLS[module] is None or attr in FILE_CALLS[module]):
                found.append((node.lineno, ".".join(chain)))
    return found


@pytest.mark.parametrize(
    ("code", "calls"),
    [
        ("fd = os.open(p, os.O_WRONLY)\nos.pwrite(fd, b'x', 0)", [(1, "os.open"), (2, "os.pwrite")]),
        ("os.rename(a, b); shutil.rmtree(a)", [(1, "os.rename"), (1, "shutil.rmtree")]),
        ("d = tempfile.mkdtemp()\nif os.path.exists(d): pass", [(1, "tempfile.mkdtemp"), (2, "os.path.exists")]),
        ("with open(p, 'w') as f: f.write(t)", [(1, "open")]),
        ("staging.create(name, size, head); writer.pwrite(0, data)", []),
        ("os.fspath(p)", []),  # no file touched
    ],
)
def test_the_file_call_check_sees_them(code, calls):
    assert file_calls(code) == calls


def test_the_save_touches_files_only_through_the_storage():
    """``loader/save/`` makes no file system call (``os``, ``os.path``, ``tempfile``, ``shutil``, ``open``): it
    writes through the storage's write side (:class:`loader.storage.Staging`), whose local driver
    (:mod:`loader.storage.local_write`, :mod:`~loader.storage.local_commit`) makes them."""
    bad = {p.name: found for p in sorted(SAVE_PACKAGE.glob("*.py")) for found in [file_calls(p.read_text())] if found}
    assert not bad, bad


# -- the collectives of a distributed flow -----------------------------------------------------------------------------

COLLECTIVES_MODULE = ROOT / "loader" / "distributed" / "collectives.py"

#: ``torch.distributed`` calls that move data between ranks: made only by the collectives module
COLLECTIVE_CALLS = {
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "recv",
    "reduce",
    "scatter",
    "scatter_object_list",
    "send",
}


def collective_uses(source: str) -> list[tuple[int, str]]:
    """Each ``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` call in ``source`` and each
    ``"nccl"`` literal (a device choice by backend), as ``(line, what)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_CALLS:
            base = node.func.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
            if name in ("dist", "distributed"):
                found.append((node.lineno, node.func.attr))
        elif isinstance(node, ast.Constant) and node.value == "nccl":
            found.append((node.lineno, "nccl"))
    return found


@pytest.mark.parametrize(
    ("code", "uses"),
    [
        ("dist.all_gather_object(out, mine)", [(1, "all_gather_object")]),
        ("torch.distributed.broadcast(t, src=0)", [(1, "broadcast")]),
        ("if dist.get_backend() == 'nccl': pass", [(1, "nccl")]),
        ("session.gather(data); peers.all_to_all_bytes(sends, sizes)", []),
    ],
)
def test_the_collective_check_sees_them(code, uses):
    assert collective_uses(code) == uses


def test_collectives_and_the_device_choice_live_in_one_module():
    """Every rank-to-rank data movement of the loader goes through :mod:`loader.distributed.collectives` (one gather
    channel, each collective over a ``group`` with a timeout), which alone chooses the device by backend."""
    bad = {
        str(p.relative_to(ROOT)): found
        for p in sorted((ROOT / "loader").rglob("*.py"))
        if p != COLLECTIVES_MODULE
        for found in [collective_uses(p.read_text())]
        if found
    }
    assert not bad, bad


# ----------------------------------------------------------------------------------------------- checkpoints


def checkpoint_probes(source: str) -> list[int]:
    """Lines that ``getattr``/``hasattr`` a checkpoint (a name or attribute ``checkpoint``): a
    :class:`~loader.checkpoint.Checkpoint` has its members, so nothing probes for them."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            first = node.args[0] if node.args else None
            name = first.attr if isinstance(first, ast.Attribute) else getattr(first, "id", None)
            if name == "checkpoint":
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    "code, probes",
    [
        ('x = getattr(checkpoint, "identities", None) or {}', [1]),
        ('x = getattr(plan.checkpoint, "identities", None)', [1]),
        ('if hasattr(self.checkpoint, "store"):\n    pass', [1]),
        ("x = checkpoint.identities\ny = getattr(reader, 'cached', None)", []),
    ],
)
def test_the_checkpoint_probe_check_sees_them(code, probes):
    assert checkpoint_probes(code) == probes


def test_checkpoints_are_not_probed():
    """Every checkpoint implements the protocol (``identities``, ``store``, ``reader`` always present)."""
    bad = [
        f"{path.relative_to(ROOT)} line {line}"
        for path in sorted((ROOT / "loader").rglob("*.py"))
        for line in checkpoint_probes(path.read_text())
    ]
    assert not bad, "a checkpoint's member is probed instead of read:\n" + "\n".join(bad)


def _project_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from loader… / regiontrace… import name`` in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in ("loader", "regiontrace"):
                found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def test_benches_and_tests_import_names_that_exist():
    """A bench or test importing a moved name (often inside a function, run only by hand) fails here first."""
    import importlib

    missing = []
    for path in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "tests").glob("*.py")]):
        for line, module, name in _project_imports(path):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {module} ({e})")
                continue
            if name != "*" and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_vllm_is_imported_only_by_loader_vllm_and_only_when_used():
    """``import loader`` (and ``import loader.vllm``) never imports vLLM: only functions of loader/vllm/ do, and its
    model loader module (imported by the plugin function when vLLM loads it)."""
    bad = []
    for path in sorted([*(ROOT / "loader").rglob("*.py"), *(ROOT / "regiontrace").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        inside_vllm = path.parent == ROOT / "loader" / "vllm"
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            if not any(n == "vllm" or n.startswith("vllm.") for n in names):
                continue
            loaded_by_plugin = inside_vllm and path.name == "model_loader.py"
            if not inside_vllm or (id(node) in top_level and not loaded_by_plugin):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "vLLM imported outside loader/vllm's functions: " + ", ".join(bad)
    out = subprocess.run(
        [sys.executable, "-c", "import sys, loader, loader.vllm; print('vllm' in sys.modules)"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False"
