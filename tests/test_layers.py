"""The core's packages form floors: each imports only from the floors below it, so no import runs back up
and no two packages import each other. The graph is built from the source: every import, also those inside
functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import erdma_core

CORE = Path(erdma_core.__file__).parent

# lowest first; a package imports only from packages on lower floors. ``protocol`` is the ground floor: it
# imports nothing of the core. ``__init__`` is the package's front door (``import erdma_core``), above what it
# exports and below the front ends that use it.
FLOORS: list[set[str]] = [
    {"protocol", "errors"},
    {"wire", "net", "logs"},
    {"config", "compression", "traversal", "algorithms"},
    {"security"},
    {"transport"},
    {"discovery"},
    {"plugins"},
    {"engine"},
    {"api", "toolkit"},
    {"sdk"},
    {"__init__"},
    {"elastic", "torch"},
    {"cli", "torchft"},
    {"testing"},
]
FLOOR = {pkg: n for n, floor in enumerate(FLOORS) for pkg in floor}


def _package(rel: Path) -> str:
    """``engine/ops.py`` -> ``engine``; ``errors.py`` -> ``errors``; ``__init__.py`` -> ``__init__``."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module(rel: Path) -> list[str]:
    parts = ["erdma_core", *rel.with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(root: Path, name: str = "erdma_core") -> list[tuple[str, str, str]]:
    """``(package, imported package, "file:line")`` for every import between two packages under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        here = _package(rel)
        module = _module(rel)
        is_package = rel.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per further dot
                    base = module[:len(module) - node.level + (1 if is_package else 0)]
                else:
                    base = []
                head = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{head}.{a.name}" for a in node.names] if head == name else [head]
            for target in targets:
                parts = target.split(".")
                if parts[0] != name:
                    continue
                there = parts[1] if len(parts) > 1 else "__init__"
                if there not in {_package(p.relative_to(root)) for p in root.iterdir() if p.suffix == ".py"
                                 or (p / "__init__.py").exists()}:
                    there = "__init__"  # a name the package's front door exports
                if there != here:
                    found.append((here, there, f"{rel}:{node.lineno}"))
    return found


def upward(root: Path, name: str = "erdma_core") -> list[str]:
    """Every import into the same or a higher floor, and every package that has no floor."""
    bad = []
    for here, there, where in imports(root, name):
        if here not in FLOOR or there not in FLOOR:
            bad.append(f"{where}: {here} -> {there}: a package with no floor in tests/test_layers.py")
        elif FLOOR[there] >= FLOOR[here]:
            bad.append(f"{where}: {here} (floor {FLOOR[here]}) imports {there} (floor {FLOOR[there]})")
    return bad


def test_every_import_between_the_cores_packages_runs_down() -> None:
    assert upward(CORE) == []


def test_every_package_of_the_core_has_a_floor() -> None:
    packages = {_package(p.relative_to(CORE)) for p in CORE.iterdir()
                if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert packages - FLOOR.keys() == set()


def test_the_ground_floor_imports_nothing_of_the_core() -> None:
    assert [where for here, _, where in imports(CORE) if here == "protocol"] == []


def test_the_walk_finds_an_upward_import_a_lazy_one_and_a_package_without_a_floor(tmp_path: Path) -> None:
    """The checker itself, on a made-up package: it must not pass by finding nothing."""
    pkg = tmp_path / "erdma_core"
    for sub in ("protocol", "engine", "config", "gadgets"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .engine import run\n")
    (pkg / "config" / "schema.py").write_text("def f():\n    from ..engine.ops import X\n    return X\n")
    (pkg / "engine" / "run.py").write_text("from ..protocol import ops\nfrom erdma_core.config import schema\n")
    (pkg / "protocol" / "ops.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .. import errors\n")
    (pkg / "gadgets" / "g.py").write_text("from ..engine import run\n")
    (pkg / "errors.py").write_text("")
    bad = upward(pkg)
    assert "config/schema.py:2: config (floor 2) imports engine (floor 7)" in bad
    assert "protocol/ops.py:3: protocol (floor 0) imports errors (floor 0)" in bad
    assert "gadgets/g.py:1: gadgets -> engine: a package with no floor in tests/test_layers.py" in bad
    assert not [b for b in bad if b.startswith("engine/run.py")]  # engine -> protocol, config: down
    assert not [b for b in bad if b.startswith("__init__.py")]


@pytest.mark.parametrize("floor", range(len(FLOORS)))
def test_no_package_sits_on_two_floors(floor: int) -> None:
    assert all(FLOORS[floor].isdisjoint(other) for n, other in enumerate(FLOORS) if n != floor)


def module_imports(root: Path, name: str = "erdma_core") -> dict[str, set[str]]:
    """Each module's (file's, relative to ``root``) imports of other modules under ``root``, lazy ones and
    those under ``TYPE_CHECKING`` too: ``from .pkg import x`` is ``pkg/x.py`` where that file exists, else
    ``pkg/__init__.py``."""
    def file_of(parts: list[str]) -> str | None:
        rel = Path(*parts[1:]) if len(parts) > 1 else Path()
        if (root / rel).with_suffix(".py").is_file() and parts[1:]:
            return str(rel.with_suffix(".py"))
        if (root / rel / "__init__.py").is_file():
            return str(rel / "__init__.py")
        return None

    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        module = _module(rel)
        is_package = rel.name == "__init__.py"
        edges = graph.setdefault(str(rel), set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[list[str]] = []
            if isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = module[:len(module) - node.level + (1 if is_package else 0)] if node.level else []
                head = base + (node.module.split(".") if node.module else [])
                targets = [[*head, a.name] for a in node.names]
            for parts in targets:
                if parts[0] != name:
                    continue
                found = file_of(parts) or file_of(parts[:-1])
                if found is not None and found != str(rel):
                    edges.add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_two_modules_of_the_core_import_each_other_even_through_others() -> None:
    """The floors see packages; this sees files: two modules of one package that import each other (also
    lazily, or for type hints only) are a cycle too."""
    assert cycles(module_imports(CORE)) == []


def test_the_module_walk_finds_a_cycle_through_a_lazy_and_a_type_only_import(tmp_path: Path) -> None:
    pkg = tmp_path / "erdma_core"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "engine" / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from . import c\n")
    (pkg / "engine" / "c.py").write_text("from erdma_core.engine.a import f\n")
    (pkg / "engine" / "d.py").write_text("from .a import f\n")
    assert cycles(module_imports(pkg)) == [["engine/a.py", "engine/b.py", "engine/c.py"]]


def test_only_the_transport_package_and_the_registration_reach_the_tcp_transport() -> None:
    """Discovery, the API and the SDK stand on ``security`` and ``net`` and on the stream transports' base, not
    on the built-in TCP: only ``plugins/builtin.py`` names it, to register it as a plugin registers its own."""
    reach = sorted(f"{src} -> {dst}" for src, dsts in module_imports(CORE).items() for dst in dsts
                   if dst.startswith("transport/tcp/") and not src.startswith("transport/"))
    assert reach == ["plugins/builtin.py -> transport/tcp/__init__.py"]
