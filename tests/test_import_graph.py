"""No import cycles among the project's modules.

Every module of the packages pyproject.toml installs (``tiered``, ``tiered.codecs`` and the
folders mapped to ``tiered.cpu``, ``tiered.metal``, ``tiered.scheduler``) is parsed, and every
import in it is an edge, wherever it stands: at module level, inside a function or a class,
under ``if TYPE_CHECKING``. A function-local import that only dodges a cycle therefore still
closes it here, and fails this test. Edges:

- ``import a.b`` and ``from a import b``: to the project module ``a.b`` where there is one, else
  to the nearest enclosing project module (``from tiered.cpu import HostStore``: ``tiered.cpu``,
  whose ``__init__`` holds the name);
- the parent packages Python initialises on the way to a submodule are not edges (a package's
  ``__init__`` that imports its own submodules would otherwise always be a cycle).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BENCH_ONLY = ("matplotlib",)  # the "bench" extra of pyproject.toml

# tiered's subpackages from the lowest: a module imports its own level and the levels below
# ("tiered": the package's own modules, the public face). The codecs and the kernel packages
# (tiered.codecs, .cpu, .metal, .scheduler) are the foundations every level may use; they
# themselves use only tiered.runtime and tiered.options. Each subpackage's __init__ says so.
LADDER = ("runtime", "options", "planning", "step", "layer", "persistence", "tiered",
          "shard", "commands")
FOUNDATIONS = ("codecs", "cpu", "metal", "scheduler")
ENTRY_POINTS = {("tiered.__main__", "tiered.commands.cli")}  # ``python -m tiered``

# Edges left out of the check until their owner removes the cycle. Each entry must say why.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}


def _toml_packages(text: str) -> tuple[list[str], dict[str, str]]:
    """(packages, package-dir) of pyproject.toml's [tool.setuptools]."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    setup = tomllib.loads(text)["tool"]["setuptools"]
    return list(setup["packages"]), dict(setup.get("package-dir", {}))


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> source file of every module the project installs."""
    packages, package_dir = _toml_packages((root / "pyproject.toml").read_text())
    modules = {}
    for pkg in packages:
        # a package's folder: its own mapping, else its parent's folder + its last name
        parts = pkg.split(".")
        for i in range(len(parts), 0, -1):
            head = ".".join(parts[:i])
            if head in package_dir:
                folder = root / package_dir[head] / Path(*parts[i:])
                break
        else:
            folder = root / Path(*parts)
        assert (folder / "__init__.py").is_file(), f"{pkg}: no {folder}/__init__.py"
        for f in sorted(folder.glob("*.py")):
            modules[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return modules


def imported_names(path: Path):
    """(absolute module name as written, line) of every import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module, node.lineno


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    """module -> {imported project module: ["file:line (local)", ...]}."""
    edges: dict[str, dict[str, list[str]]] = {m: {} for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        local = {id(n) for fn in ast.walk(tree)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn)}
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [_resolve(a.name, modules) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                           else _resolve(base, modules) for a in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}" + (
                " (function-local)" if id(node) in local else "")
            for t in dict.fromkeys(targets):
                if t is not None and t != mod:
                    edges[mod].setdefault(t, []).append(where)
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per strongly connected component of more
    than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(comp)
    cycles = []
    for comp in comps:  # the shortest way from the first module back to itself
        first = min(comp)
        prev, queue = {}, deque([first])
        while queue:
            v = queue.popleft()
            if first in graph[v]:
                path = [first]
                while v != first:
                    path.append(v)
                    v = prev[v]
                cycles.append([first] + path[:0:-1] + [first])
                break
            for w in sorted(graph[v] & comp):
                if w not in prev and w != first:
                    prev[w] = v
                    queue.append(w)
    return cycles


def describe(cycle: list[str], edges) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"  {a} -> {b}: {', '.join(edges[a][b])}")
    return "\n".join(lines)


def test_cycle_finder_sees_a_cycle_and_its_absence():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    graph["c"] = {"d"}
    assert find_cycles(graph) == []


def test_every_module_is_found():
    modules = project_modules()
    for name in ("tiered", "tiered.cache", "tiered.codecs", "tiered.cpu.pages",
                 "tiered.metal.tau", "tiered.scheduler.pool"):
        assert name in modules, name
    # the files on disk: every .py of the mapped folders is one of them
    folders = ("tiered", "cpu", "metal", "scheduler") + tuple(
        f"tiered/{d}" for d in ("codecs",) + LADDER if d != "tiered")
    on_disk = {p.resolve() for d in folders for p in (ROOT / d).glob("*.py")}
    assert on_disk == {p.resolve() for p in modules.values()}


def test_no_import_cycles():
    modules = project_modules()
    edges = import_edges(modules)
    graph = {m: {t for t in targets if (m, t) not in ALLOWED_EDGES}
             for m, targets in edges.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(
        describe(c, edges) for c in cycles)


def test_allowed_edges_are_real():
    """An allowance for an edge that no longer exists is stale: remove it."""
    edges = import_edges(project_modules())
    stale = [f"{a} -> {b}" for a, b in ALLOWED_EDGES if b not in edges.get(a, {})]
    assert not stale, f"ALLOWED_EDGES lists edges no module has any more: {stale}"


def test_the_package_never_imports_benchmark_libraries():
    """matplotlib is the ``bench`` extra (pyproject.toml): only bench/ may plot."""
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in project_modules().values()
             for name, line in imported_names(path)
             if name.split(".")[0] in BENCH_ONLY]
    assert not found, found


def test_no_import_cycles_among_the_benchmarks():
    # bench/ scripts import each other by bare module name (bench/ and bench/probes/ on
    # sys.path): a module named like a file there is an edge to it
    files = {p.stem: p for d in ("bench", "bench/probes") for p in (ROOT / d).glob("*.py")}
    assert len(files) == len(list((ROOT / "bench").glob("*.py"))) + len(
        list((ROOT / "bench" / "probes").glob("*.py"))), "two bench modules share a name"
    edges: dict[str, dict[str, list[str]]] = {}
    for name, path in files.items():
        out = edges.setdefault(name, {})
        for module, line in imported_names(path):
            top = module.split(".")[0]
            if top in files and top != name:
                out.setdefault(top, []).append(f"line {line}")
    cycles = find_cycles({m: set(t) for m, t in edges.items()})
    assert not cycles, "import cycles among bench/ modules:\n" + "\n".join(
        describe(c, edges) for c in cycles)


def level(module: str) -> int | str:
    """A module's rung on :data:`LADDER`, or the foundation package it belongs to."""
    part = module.split(".")[1] if "." in module else "tiered"
    if part in FOUNDATIONS:
        return part
    return LADDER.index(part) if part in LADDER else LADDER.index("tiered")


def upward(edges) -> list[str]:
    """The imports that go up the ladder, or from a foundation to above tiered.options."""
    bad = []
    for mod, targets in edges.items():
        for t, where in targets.items():
            a, b = level(mod), level(t)
            if (mod, t) in ENTRY_POINTS or isinstance(b, str):
                continue
            if isinstance(a, str):
                if b > LADDER.index("options"):
                    bad.append(f"{mod} -> {t} (a foundation reaching up): {', '.join(where)}")
            elif b > a:
                bad.append(f"{mod} ({LADDER[a]}) -> {t} ({LADDER[b]}): {', '.join(where)}")
    return bad


def test_the_ladder_check_sees_an_upward_import():
    edges = {"tiered.step.keys": {"tiered.layer.heavy": ["keys.py:1"],
                                  "tiered.runtime.ops": ["keys.py:2"]},
             "tiered.cpu.pages": {"tiered.planning.layout": ["pages.py:3"]},
             "tiered.__main__": {"tiered.commands.cli": ["__main__.py:4"]}}
    assert upward(edges) == [
        "tiered.step.keys (step) -> tiered.layer.heavy (layer): keys.py:1",
        "tiered.cpu.pages -> tiered.planning.layout (a foundation reaching up): pages.py:3"]


def test_subpackages_import_only_down_the_ladder():
    modules = project_modules()
    assert {m.split(".")[1] for m in modules if m.count(".") >= 2 and
            m.split(".")[1] not in FOUNDATIONS} == set(LADDER) - {"tiered"}
    bad = upward(import_edges(modules))
    assert not bad, "imports up the ladder of subpackages:\n" + "\n".join(bad)
