"""Rewrite the generated regions of the docs from the code, so numbers and
lists that change (known findings and root causes, targets, oracles, planted
bugs, tests, commands, the code map, the floors of the architecture) are never typed by hand.

A region is marked in README.md, docs/*.md or tests/README.md as

    <!-- generated: NAME -->...<!-- /generated -->

on one line (an inline value) or over several (a block). NAME is one of the
keys of GENERATORS below (lowercase: an upper-case NAME, as here, is no
region); the same NAME may appear in several places.

    python ci/gen_docs.py           # rewrite every region in place, and the files generated whole
    python ci/gen_docs.py --check   # exit 1 and name each stale region or file (tests/test_docs.py runs this)

Files generated whole (WHOLE): fuzzshard/known/README.md, `fuzzshard known --markdown`'s page.

Reads files and imports only torch-free modules (fuzzshard.cli, .oracle,
.targets; tests/test_imports.py, whose FLOORS the architecture's regions show):
it runs in a few seconds.
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KNOWN = ROOT / "fuzzshard" / "known"
_DOCSTRING = re.compile(r'\s*(?:#[^\n]*\n\s*)*((?:[rRuU])?(?:"""(?:[^\\]|\\.)*?"""|\'\'\'(?:[^\\]|\\.)*?\'\'\'))', re.S)
REGION = re.compile(r"<!-- generated: ([a-z0-9-]+) -->(.*?)<!-- /generated -->", re.S)


_TRACKED: list = []


def _listed(paths) -> list[Path]:
    """Of ``paths``, those git tracks (when this is a git checkout), so another engineer's file not yet added
    changes no generated region here; in a clean clone (CI) that is every file."""
    if not _TRACKED:
        try:
            out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=30)
            _TRACKED.append(set(out.stdout.split("\0")) if out.returncode == 0 else None)
        except OSError:  # no git: every file there is
            _TRACKED.append(None)
    tracked = _TRACKED[0]
    return [p for p in paths if p.exists() and (tracked is None or _rel(p) in tracked)]


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.exists()]


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def first_sentence(text: str, limit: int = 180) -> str:
    """The first sentence of a docstring's first paragraph, on one line, cut at a word."""
    para = " ".join((text or "").strip().split("\n\n")[0].split())
    m = re.search(r"(?<=[a-z0-9)`'\"])\.(\s|$)", para)
    s = para[:m.start() + 1] if m else para
    if len(s) > limit:
        s = s[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return s.replace("|", "/")


def module_doc(path: Path) -> str:
    text = path.read_text()
    # the leading string literal, read without parsing the whole module (this runs over every module, in a test)
    m = _DOCSTRING.match(text)
    if m:
        try:
            return inspect.cleandoc(ast.literal_eval(m.group(1)))
        except (SyntaxError, ValueError):
            pass
    if path.suffix != ".py":  # a shell script: its leading comment
        lines = [ln[1:].strip() for ln in text.splitlines()[1:] if ln.startswith("#") and not ln.startswith("#!")]
        head = []
        for ln in lines:
            if not ln or ln.startswith("SBATCH"):
                break
            head.append(ln)
        return " ".join(head)
    try:
        return ast.get_docstring(ast.parse(text)) or ""
    except SyntaxError:  # a file half-way through an edit (or newer syntax than this Python): its leading string
        m = re.match(r'\s*(?:#[^\n]*\n\s*)*[rRuU]?("""|\'\'\')(.*?)\1', text, re.S)
        return m.group(2) if m else ""


# ---- the known list: its numbers said where fuzzshard/cli/known.py says them (one place), and its README, which
# `fuzzshard known --markdown` writes whole

@functools.lru_cache(maxsize=None)
def _known():
    from fuzzshard.cli import known
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes

    findings = load_known(KNOWN)
    return known, findings, load_root_causes(findings, known_dir=KNOWN)


def known_counts() -> str:
    known, findings, causes = _known()
    return known.counts_text(findings, causes)


def known_short() -> str:
    known, findings, causes = _known()
    return known.short_text(findings, causes)


def known_readme() -> str:
    """fuzzshard/known/README.md, whole (a generated file, not a file with generated regions)."""
    known, findings, _ = _known()
    return known.known_markdown(findings) + "\n"


WHOLE = {KNOWN / "README.md": known_readme}  # files generated whole: --check compares, a run rewrites them


# ---- targets, oracles, commands ---------------------------------------------------------------------

def targets_table() -> str:
    from fuzzshard import targets

    rows = ["| target | module | what it is |", "|---|---|---|"]
    for name in targets.names():
        path = ROOT / "fuzzshard" / "kernel" / "targets" / f"{name}.py"
        if not path.exists():  # a target that is a package (pp/): its __init__ says what it is
            path = path.with_suffix("") / "__init__.py"
        shown = _rel(path.parent) + "/" if path.name == "__init__.py" else _rel(path)
        doc = first_sentence(module_doc(path)).split(": ", 1)[-1]
        rows.append(f"| `{name}` | `{shown}` | {doc} |")
    return "\n".join(rows)


def ac_table() -> str:
    """Activation checkpointing: which forms each target draws (its Spec's ``ac``; kernel/ac.py)."""
    from fuzzshard import targets
    from fuzzshard.kernel import ac

    names = targets.names()
    rows = ["| form | what runs | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|---|" + "---|" * len(names)]
    for how, what in ac.AC_HOWS.items():
        marks = ["yes" if how in targets.get(n).spec.ac else "–" for n in names]
        rows.append(f"| `{how}` | {what} | " + " | ".join(marks) + " |")
    return "\n".join(rows)


def dropout_table() -> str:
    """Dropout: how each target's masks are judged (its Spec's ``dropout``; kernel/dropout.py)."""
    from fuzzshard import targets

    words = {"replay": "replayed by the reference", "replica": "loss and grads not compared", "": "not drawn"}
    names = targets.names()
    rows = ["| " + " | ".join(f"`{n}`" for n in names) + " |", "|" + "---|" * len(names)]
    return "\n".join(rows + ["| " + " | ".join(words[targets.get(n).spec.dropout] for n in names) + " |"])


def target_count() -> str:
    from fuzzshard import targets

    return str(len(targets.names()))


def target_names() -> str:
    from fuzzshard import targets

    return ", ".join(f"`{n}`" for n in targets.names())


def oracles_table() -> str:
    from fuzzshard import oracle

    rows = ["| oracle | a finding shows as | module (driver side) | what fails |", "|---|---|---|---|"]
    for name, o in oracle.ORACLES.items():
        path = ROOT / "fuzzshard" / "oracle" / f"{name}.py"
        doc = first_sentence(module_doc(path), 220).split(": ", 1)[-1]
        rows.append(f"| `{name}` | {o.kind} | `{_rel(path)}` | {doc} |")
    return "\n".join(rows)


def oracle_count() -> str:
    from fuzzshard import oracle

    return str(len(oracle.ORACLES))


def _parser():
    from fuzzshard import cli

    return cli._parser()


def _subcommands():
    import argparse

    ap = _parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    return [(name, p, helps.get(name) or first_sentence(p.description or "")) for name, p in sub.choices.items()]


def commands_table() -> str:
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| `fuzzshard {name}` | {' '.join(h.split()).replace('|', '/')} |" for name, _, h in _subcommands()]
    return "\n".join(rows)


def commands_usage() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal's width: fixed, so the output is the same anywhere
    try:
        out = []
        for name, p, _ in _subcommands():
            usage = p.format_usage().strip()
            out.append(f"### `fuzzshard {name}`\n\n{' '.join((p.description or '').split())}\n\n```text\n{usage}\n```")
        return "\n\n".join(out)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


# ---- tests and planted bugs -------------------------------------------------------------------------

def _test_files() -> list[Path]:
    return _listed(sorted((ROOT / "tests").rglob("test_*.py")))


def _test_functions(path: Path) -> list[str]:
    text = path.read_text()
    top = re.findall(r"^(?:async )?def (test\w*)", text, re.M)  # pytest's rule: test* functions at the top level
    if "class Test" not in text:
        return top
    try:
        tree = ast.parse(text)
    except SyntaxError:  # half-way through an edit
        return top
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test")]
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and c.name.startswith("Test"):
            names += [f"{c.name}.{n.name}" for n in c.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    return names


def tests_table() -> str:
    rows = ["| file | tests | what it proves (its docstring) |", "|---|---|---|"]
    total = 0
    for p in _test_files():
        n = len(_test_functions(p))
        total += n
        rows.append(f"| `{_rel(p)}` | {n} | {first_sentence(module_doc(p), 240)} |")
    rows.append(f"| {len(_test_files())} files | {total} | |")
    return "\n".join(rows)


def test_count() -> str:
    return f"{sum(len(_test_functions(p)) for p in _test_files())} test functions in {len(_test_files())} files"


def _planted() -> list[Path]:
    return _listed(sorted(p for p in (ROOT / "tests" / "planted").glob("*.py") if not p.name.startswith("_")))


def planted_table() -> str:
    tests = {p: p.read_text() for p in _test_files()}
    rows = ["| planted bug | what it breaks | used by |", "|---|---|---|"]
    for p in _planted():
        users = sorted(_rel(t) for t, text in tests.items() if p.name in text or f'"{p.stem}"' in text)
        doc = first_sentence(module_doc(p), 260).removeprefix("Planted bug: ")
        rows.append(f"| `{p.name}` | {doc} | {', '.join(f'`{u}`' for u in users) or '(no test names it)'} |")
    return "\n".join(rows)


def planted_count() -> str:
    return str(len(_planted()))


# ---- the code map -----------------------------------------------------------------------------------

def code_map() -> str:
    skip = {"__main__.py"}
    lines = ["```text"]
    paths = [p for d in ("fuzzshard", "strategies") for p in sorted((ROOT / d).rglob("*.py"))
             if "known" not in p.relative_to(ROOT).parts and p.name not in skip]
    paths += [p for p in sorted((ROOT / "ci").rglob("*")) if p.suffix in (".py", ".sh", ".sbatch")]
    paths = _listed(paths)
    paths.sort(key=lambda p: (p.parent.relative_to(ROOT).as_posix(), p.name != "__init__.py", p.name))
    width = max(len(_rel(p)) for p in paths) + 2
    for p in paths:
        rel = _rel(p)
        shown = rel[:-len("__init__.py")] if p.name == "__init__.py" else rel
        lines.append(f"{shown:{width}}{first_sentence(module_doc(p), 120).replace('`', '')}")
    lines.append("```")
    return "\n".join(lines)


def folders() -> str:
    """The README's map: the packages (each one's docstring says what it holds) and the top-level modules."""
    rows = ["```text"]
    # in the order a case flows: drawn, run, judged, handed over; a package not named here comes last
    flow = ["strategies", "session", "pool", "kernel", "oracle", "findings", "scriptgen", "report", "cli"]
    pkgs = sorted([ROOT / "strategies" / "__init__.py", *(ROOT / "fuzzshard").glob("*/__init__.py")],
                  key=lambda p: (flow.index(p.parent.name) if p.parent.name in flow else len(flow), p.parent.name))
    top = _listed(sorted(p for p in (ROOT / "fuzzshard").glob("*.py") if p.name not in ("__init__.py", "__main__.py")))
    shown = [(_rel(p.parent) + "/", module_doc(p)) for p in _listed(pkgs)]
    shown += [("fuzzshard/" + ", ".join(p.stem for p in top), "the Case and the Verdict that cross to the ranks and back; targets, plugins, "
               "pytest, torch versions")]
    shown += [("tests/  ci/  docs/", "the suite and its planted bugs, CI and cluster scripts, these pages")]
    width = max(len(name) for name, _ in shown[:-2]) + 2
    for name, doc in shown:
        rows.append(f"{name:{width}}{first_sentence(doc, 100).replace('`', '')}" if len(name) < width
                    else f"{name}\n{'':{width}}{first_sentence(doc, 100).replace('`', '')}")
    rows.append("```")
    return "\n".join(rows)


# ---- the architecture: the floors, defined once in tests/test_imports.py (FLOORS, APART, UPWARD), and the arrows
# between rooms the code has today (that test's reader of the import graph: every import, at any level)

@functools.lru_cache(maxsize=None)
def _floors():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzzshard_floors", ROOT / "tests" / "test_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _room_path(room: str) -> str:
    """A room's place in the repository: fuzzshard/kernel/, fuzzshard/case.py, strategies/ (fuzzshard.strategies),
    fuzzshard/__init__.py (the package's face), fuzzshard/known/ (a folder of no module)."""
    mods = _floors().modules()
    if room == "fuzzshard" or room not in mods:
        return "fuzzshard/__init__.py" if room == "fuzzshard" else room.replace(".", "/") + "/"
    path, package = mods[room]
    return _rel(path.parent) + "/" if package else _rel(path)


def _room_short(room: str) -> str:
    return _room_path(room).removeprefix("fuzzshard/")


def architecture_floors() -> str:
    """docs/architecture.md's floors: each room, what it holds (its docstring) and the rooms it imports today."""
    fl = _floors()
    edges = fl.graph(function_level=True)
    uses: dict = {}
    for a, ts in edges.items():
        uses.setdefault(fl.room(a), set()).update(fl.room(b) for b in ts if fl.room(b) != fl.room(a))
    order = [r for _, rooms in fl.FLOORS for r in rooms]
    rows = ["| floor | room | what it holds | imports today |", "|---|---|---|---|"]
    for i, (what, rooms) in enumerate(fl.FLOORS):
        for j, r in enumerate(rooms):
            first = f"**{len(fl.FLOORS) - i}**: {what}" if j == 0 else ""
            imported = sorted(uses.get(r, ()), key=lambda u: (order.index(u) if u in order else len(order), u))
            doc = first_sentence(module_doc(fl.modules()[r][0]), 110).replace("`", "")
            up = [f"{_room_short(u)} (up, see below)" if any(fl.room(a) == r and fl.room(b) == u for a, b in fl.UPWARD) else
                  _room_short(u) for u in imported]
            rows.append(f"| {first} | `{_room_path(r)}` | {doc} | {', '.join(up) or '-'} |")
    return "\n".join(rows)


def architecture_exceptions() -> str:
    """docs/architecture.md's arrows that go up a floor (UPWARD, by reason) and the rooms on no floor (APART)."""
    fl = _floors()
    by_reason: dict = {}
    for (a, b), why in fl.UPWARD.items():
        by_reason.setdefault((a, why), []).append(b)
    rows = [f"- up: `{_rel(fl.modules()[a][0])}` -> {', '.join(f'`{_rel(fl.modules()[b][0])}`' for b in sorted(bs))}: {why}"
            for (a, why), bs in sorted(by_reason.items())] or ["- up: none"]
    rows += [f"- apart: `{_room_path(r)}`: {why}" for r, why in fl.APART.items()]
    return "\n".join(rows)


GENERATORS = {
    "architecture-floors": architecture_floors,
    "architecture-exceptions": architecture_exceptions,
    "folders": folders,
    "known-counts": known_counts,
    "known-short": known_short,
    "targets": targets_table,
    "target-count": target_count,
    "ac": ac_table,
    "dropout": dropout_table,
    "target-names": target_names,
    "oracles": oracles_table,
    "oracle-count": oracle_count,
    "commands": commands_table,
    "commands-usage": commands_usage,
    "tests": tests_table,
    "test-count": test_count,
    "planted": planted_table,
    "planted-count": planted_count,
    "code-map": code_map,
}


def render(text: str, cache: dict) -> str:
    """``text`` with every region's body regenerated."""
    def sub(m):
        name, body = m.group(1), m.group(2)
        if name not in GENERATORS:
            raise KeyError(f"unknown generated region {name!r} (known: {', '.join(GENERATORS)})")
        if name not in cache:
            cache[name] = GENERATORS[name]()
        new = cache[name]
        block = "\n" in body or "\n" in new
        return f"<!-- generated: {name} -->" + (f"\n{new}\n" if block else new) + "<!-- /generated -->"

    return REGION.sub(sub, text)


def stale() -> list[str]:
    """'FILE: NAME' for each region whose text is not what the code gives now, and 'FILE' for each file
    generated whole that is not."""
    cache: dict = {}
    out = []
    for p in doc_files():
        text = p.read_text()
        for old, new in zip(REGION.finditer(text), REGION.finditer(render(text, cache))):
            if old.group(0) != new.group(0):
                out.append(f"{_rel(p)}: {old.group(1)}")
    for p, make in WHOLE.items():
        if not p.exists() or p.read_text() != make():
            out.append(f"{_rel(p)} (generated whole)")
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="ci/gen_docs.py", description=__doc__.split("\n\n")[0],
                                 epilog="Without --check it rewrites every stale region in place, and the files "
                                        "generated whole: " + ", ".join(_rel(p) for p in WHOLE) + ".")
    ap.add_argument("--check", action="store_true", help="change nothing: exit 1 and name each stale region or file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(ROOT))
    if args.check:
        bad = stale()
        for b in bad:
            print(f"stale generated region {b}")
        if bad:
            print("run: python ci/gen_docs.py")
        return 1 if bad else 0
    cache: dict = {}
    for p in doc_files():
        text = p.read_text()
        new = render(text, cache)
        if new != text:
            p.write_text(new)
            print(f"rewrote {_rel(p)}")
    for p, make in WHOLE.items():
        new = make()
        if not p.exists() or p.read_text() != new:
            p.write_text(new)
            print(f"rewrote {_rel(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
