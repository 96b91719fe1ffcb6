"""No import cycles among fuzzshard's modules and no import that goes up a floor, read from their source (no
import is run).

The graph: module A -> module B where A's source imports B, at the top of the
module (run when A is imported) or inside a function (run when it is called).
Both count: the cycle issue 40 removed (cli/common -> pool/runner ->
pool/worker -> session/simulate -> cli/common) was all function-level imports,
each put off to dodge the cycle it made. ``from X import name`` is an edge to
X.name where that is a module, else to X; imports under ``if TYPE_CHECKING:``
are left out (never run). A package and its own submodules are one unit
(edges between them are left out): Python runs a package's ``__init__``
before any of its submodules, and a package that imports its submodules to
register them (oracle/, scriptgen/) is the idiom, not a cycle between layers.

Module-level imports alone: 0 cycles. With function-level imports: 0 cycles
too (the last, Case.check's lazy imports of the kernel's rules, went behind the
target registry: targets.py ``case_problem``); a new one fails here.

The floors (``FLOORS``, defined here once): every room (a package of fuzzshard,
or one of its top-level modules) stands on a floor, and imports only rooms on
floors below its own, at any level; rooms on one floor import none of each
other. An arrow that goes up is listed in ``UPWARD`` with its reason, or fails
here. docs/architecture.md's floor table and exceptions are generated from
these (ci/gen_docs.py).
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import fuzzshard

ROOT = Path(fuzzshard.__file__).parent

# The floors, top to bottom: (what the floor is, its rooms). A room is a package of fuzzshard (and all its modules)
# or one top-level module; it imports only rooms on floors below its own (the kernel and the pool import no
# session, CLI, findings or report module; session/ writes what report/ reads, never the other way). A new
# package or top-level module goes on a floor here (test_every_room_stands_on_one_floor asks).
FLOORS = [
    ("the entry point", ["fuzzshard.__main__"]),
    ("the command line: arguments become typed options, once", ["fuzzshard.cli"]),
    ("pytest's plugin", ["fuzzshard.pytest_plugin"]),
    ("what a person reads, and users' own properties", ["fuzzshard.report", "fuzzshard.testing"]),
    ("sessions: the search", ["fuzzshard.session"]),
    ("a finding's life", ["fuzzshard.findings"]),
    ("the worker pool, and the script writer", ["fuzzshard.pool", "fuzzshard.scriptgen"]),
    ("the draws, the oracles as the driver knows them, plugins", ["fuzzshard.strategies", "fuzzshard.oracle",
                                                                  "fuzzshard.plugin"]),
    ("the kernel: what runs inside the ranks (and, flattened, in a repro)", ["fuzzshard.kernel"]),
    ("the Case", ["fuzzshard.case"]),
    ("the ground: they import nothing of fuzzshard", ["fuzzshard.targets", "fuzzshard.verdict", "fuzzshard.versions",
                                           "fuzzshard.duration"]),
]
# rooms on no floor: they import nothing of fuzzshard and nothing imports them (read as files, if at all)
APART = {
    "fuzzshard": "the package's face: its docstring and __version__",
    "fuzzshard.known": "the known list: finding files, and root causes' hand-reduced scripts (torch only)",
}
# the arrows that go up a floor, (importer, imported) module by module, each with its reason; remove one once it
# is gone (test_no_import_goes_up_a_floor asks that too)
UPWARD: dict = {}


def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (its file, whether it is a package's __init__). strategies/ (beside fuzzshard/ in the
    repository, installed as fuzzshard.strategies: pyproject.toml's package-dir) is fuzzshard.strategies."""
    out = {}
    trees = [(ROOT, "fuzzshard")]
    if not (ROOT / "strategies").is_dir() or (ROOT / "strategies").is_symlink():  # (a checkout's link: not walked)
        trees.append((ROOT.parent / "strategies", "fuzzshard.strategies"))
    for top, name in trees:
        for path in top.rglob("*.py"):
            parts = [*name.split("."), *path.relative_to(top).with_suffix("").parts]
            package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


@functools.lru_cache(maxsize=None)
def graph(function_level: bool) -> dict[str, frozenset[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, package) in mods.items():
        here = name if package else name.rpartition(".")[0]

        def target(node: ast.ImportFrom | ast.Import) -> list[str]:
            if isinstance(node, ast.Import):
                return [a.name for a in node.names if a.name in mods]
            base = node.module or ""
            if node.level:
                up = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out = []
            for a in node.names:
                if f"{base}.{a.name}" in mods:
                    out.append(f"{base}.{a.name}")
                elif base in mods:
                    out.append(base)
            return out

        def walk(nodes) -> None:
            for node in nodes:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    if function_level:
                        walk(ast.iter_child_nodes(node))
                elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    edges[name].update(target(node))
                else:
                    walk(ast.iter_child_nodes(node))

        walk(ast.parse(path.read_text()).body)
    # a package and its own submodules are one unit (module docstring)
    return {name: frozenset(t for t in ts if not (t == name or t.startswith(name + ".") or name.startswith(t + ".")))
            for name, ts in edges.items()}


def cycles(edges: dict) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_cycle_at_module_level():
    assert cycles(graph(function_level=False)) == []


def test_no_import_cycle_with_function_level_imports():
    found = [sorted(c) for c in cycles(graph(function_level=True))]
    assert found == [], f"import cycle(s) through function-level imports: {found}"


def room(module: str) -> str:
    """The room ``module`` is in: fuzzshard's package or top-level module that is it or holds it."""
    return ".".join(module.split(".")[:2])


def floor(module: str) -> int:
    """Its room's floor, counted from the ground (0); -1 where the room is on none."""
    r = room(module)
    return next((len(FLOORS) - 1 - i for i, (_, rooms) in enumerate(FLOORS) if r in rooms), -1)


def upward(edges: dict) -> list[tuple[str, str]]:
    """The arrows between rooms that do not go down a floor: (importer, imported), module by module."""
    return sorted((a, b) for a, ts in edges.items() for b in ts if room(a) != room(b) and floor(a) <= floor(b))


def test_every_room_stands_on_one_floor():
    names = [n for _, rooms in FLOORS for n in rooms] + list(APART)
    assert len(names) == len(set(names)), "a room on two floors"
    rooms = {room(m) for m in modules()}
    assert [n for n in names if n not in rooms or room(n) != n] == [], "a room that is not there"
    assert sorted(r for r in rooms if floor(r) < 0 and r not in APART) == [], \
        "rooms on no floor: put the package (or the top-level module) on one in FLOORS"
    edges = graph(function_level=True)
    touching = sorted((a, b) for a, ts in edges.items() for b in ts if (room(a) in APART) != (room(b) in APART))
    assert touching == [], "an APART room imports, or is imported by, fuzzshard"


def test_no_import_goes_up_a_floor():
    """Every arrow goes down (function-level imports too), but the ones UPWARD lists with their reason."""
    found = upward(graph(function_level=True))
    assert [e for e in found if e not in UPWARD] == [], "imports that go up a floor (or across one): see FLOORS"
    assert [e for e in UPWARD if e not in found] == [], "UPWARD lists an arrow that is gone: remove it"


def test_the_floors_catch_an_arrow_that_goes_up():
    edges = {"fuzzshard.kernel.run": frozenset({"fuzzshard.session.engine"}),
             "fuzzshard.pool": frozenset({"fuzzshard.scriptgen"}), "fuzzshard.cli.fuzz": frozenset({"fuzzshard.case"})}
    assert upward(edges) == [("fuzzshard.kernel.run", "fuzzshard.session.engine"), ("fuzzshard.pool", "fuzzshard.scriptgen")]
    assert room("fuzzshard.kernel.targets.pp.draws") == "fuzzshard.kernel" and floor("fuzzshard.nowhere") == -1
    assert floor("fuzzshard.case") == 1 and floor("fuzzshard.verdict") == 0


def test_the_graph_sees_a_lazy_import():
    """The reader counts an import inside a function: the worker's import of the simulated world."""
    assert "fuzzshard.kernel.simulated" in graph(function_level=True)["fuzzshard.pool.worker"]
    assert "fuzzshard.kernel.simulated" not in graph(function_level=False)["fuzzshard.pool.worker"]


def test_nothing_below_the_cli_imports_argparse_or_the_cli():
    """cli/ turns arguments into typed options once (issue 49): no module outside it imports argparse or
    fuzzshard.cli, at any level (``__main__`` is the entry point above it; a string that holds a script's
    ``import argparse``, findings/repro.py's template, is no import)."""
    bad = []
    for name, (path, _) in modules().items():
        if name.startswith("fuzzshard.cli") or name == "fuzzshard.__main__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
                    or isinstance(node, ast.ImportFrom) and node.module == "argparse" and not node.level):
                bad.append(f"{name}: imports argparse")
        bad += [f"{name}: imports {t}" for t in graph(function_level=True)[name] if t.startswith("fuzzshard.cli")]
    assert bad == []
