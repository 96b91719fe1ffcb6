"""The known list's regression table (fuzzshard/known/README.md) from saved per-release replay results.

The one-command form, which makes the missing venvs and replays on one pool per release, is
`fuzzshard bisect --known --record --torch 2.9.1,2.10.0,...`; this script joins result files that
`fuzzshard known --check --json` wrote on other machines (or on the interpreters given to --run).

    python ci/known_table.py RESULT.json [RESULT.json ...]     (also what `fuzzshard bisect --json` writes)
    python ci/known_table.py --run /work/venvs/t2100/bin/python [--run ...] [--keep DIR]

Each RESULT.json is what `fuzzshard known --check --json RESULT.json` wrote on
one release (--run runs that with each interpreter, fuzzshard installed in its
environment, and keeps the files in --keep). Every known finding's file then
records what it gave on each release (``seen_on``: {"2.10.0": "reproduces",
...}; a release checked again replaces its entry, the others stay), each root
cause's ``fixed_in`` is derived again (known/root_causes.json), and the README
is regenerated from the files (`fuzzshard known --markdown`), so the table
always says what the files say.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fuzzshard.findings.record import KNOWN_DIR
from fuzzshard.findings.knownlist import record_known
from fuzzshard.findings.releases import release_of  # noqa: F401 (this module's API)


def record(results: list[dict], known_dir: Path = KNOWN_DIR) -> list[str]:
    """Each result's outcomes into the known files' ``seen_on``, each root cause's ``fixed_in``, and the README
    (fuzzshard/findings/knownlist.py's record_known, which `fuzzshard bisect --known --record` uses too)."""
    return record_known(results, known_dir)


def releases_in(saved: dict) -> list[dict]:
    """The per-release results in a file: `known --check --json`'s is one; `fuzzshard bisect --json`'s holds
    one per release (a run that failed holds none)."""
    if "releases" not in saved:
        return [saved]
    return [{"torch": r["torch"], "results": r["results"]} for r in saved["releases"].values() if not r.get("failed")]


def run_check(python: str, keep: Path) -> dict:
    """`fuzzshard known --check --json` with this interpreter's torch; its result."""
    out = keep / f"known-{Path(python).parent.parent.name}.json"
    r = subprocess.run([python, "-m", "fuzzshard", "known", "--check", "--json", str(out)])
    if r.returncode not in (0, 1):  # 1: something is fixed or differs on that release, which is the table's point
        raise SystemExit(f"known --check with {python} exited {r.returncode}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", help="files `fuzzshard known --check --json` or `fuzzshard bisect --json` "
                    "wrote")
    ap.add_argument("--run", action="append", default=[], metavar="PYTHON",
                    help="run `known --check` with this interpreter first (repeatable)")
    ap.add_argument("--keep", default=None, help="where --run keeps its result files (default: a temp folder)")
    args = ap.parse_args(argv)
    keep = Path(args.keep or tempfile.mkdtemp(prefix="known-table-"))
    keep.mkdir(parents=True, exist_ok=True)
    results = [r for p in args.results for r in releases_in(json.loads(Path(p).read_text()))]
    results += [run_check(py, keep) for py in args.run]
    if not results:
        ap.error("no results: give RESULT.json files or --run PYTHON")
    releases = record(results)
    print(f"recorded {', '.join(releases)}; regenerated {KNOWN_DIR / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
