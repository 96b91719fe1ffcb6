"""No import cycles among fuzzshard's modules, read from their source (no import is run).

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
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import fuzzshard

ROOT = Path(fuzzshard.__file__).parent

def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["fuzzshard", *path.relative_to(ROOT).with_suffix("").parts]
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


def test_the_kernel_and_the_pool_import_nothing_above_them():
    """The ranks' side (kernel/, pool/) imports no session, CLI or findings module, at any level: the simulated
    world is the kernel's (kernel/simulated.py), not the session's."""
    above = ("fuzzshard.session", "fuzzshard.cli", "fuzzshard.findings", "fuzzshard.report")
    edges = graph(function_level=True)
    bad = {m: sorted(t for t in ts if t.startswith(above)) for m, ts in edges.items()
           if m.startswith(("fuzzshard.kernel", "fuzzshard.pool"))}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_a_session_imports_no_report_and_no_cli():
    """session/ writes what report/ reads (session/caselog.py), never the other way: no session module imports
    report/ or cli/, at any level."""
    edges = graph(function_level=True)
    bad = {m: sorted(t for t in ts if t.startswith(("fuzzshard.report", "fuzzshard.cli")))
           for m, ts in edges.items() if m.startswith("fuzzshard.session")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


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
