"""The known list's regression table: `fuzzshard known --check` on several torch
releases, joined into one table (root cause x release) in fuzzshard/known/README.md.

    python ci/known_table.py RESULT.json [RESULT.json ...]
    python ci/known_table.py --run /work/venvs/t2100/bin/python [--run ...] [--keep DIR]

Each RESULT.json is what `fuzzshard known --check --json RESULT.json` wrote on
one release (--run runs that with each interpreter, fuzzshard installed in its
environment, and keeps the files in --keep). Every known finding's file then
records what it gave on each release (``seen_on``: {"2.10.0": "reproduces",
...}; a release checked again replaces its entry, the others stay), and the
README is regenerated from the files (`fuzzshard known --markdown`), so the
table always says what the files say.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fuzzshard.cli.known import known_markdown
from fuzzshard.findings.record import KNOWN_DIR, load_known


def release_of(version: str) -> str:
    """The release a torch version is: "2.13.0+cpu" -> "2.13.0", "2.10.0+cu128" -> "2.10.0"."""
    return version.split("+", 1)[0]


def record(results: list[dict], known_dir: Path = KNOWN_DIR) -> list[str]:
    """Write each result's outcomes into the known files' ``seen_on`` (skipped: not recorded; a signature
    no longer in the list: ignored) and regenerate the README; returns the releases recorded."""
    releases = []
    by_sig: dict[str, dict[str, str]] = {}
    for res in results:
        v = release_of(res["torch"])
        releases.append(v)
        for sig, status in res["results"].items():
            if status != "skipped":
                by_sig.setdefault(sig, {})[v] = status
    for sig, seen in sorted(by_sig.items()):
        path = known_dir / f"{sig}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        data["seen_on"] = dict(sorted({**data.get("seen_on", {}), **seen}.items()))
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (known_dir / "README.md").write_text(known_markdown(load_known(known_dir)) + "\n")
    return releases


def run_check(python: str, keep: Path) -> dict:
    """`fuzzshard known --check --json` with this interpreter's torch; its result."""
    out = keep / f"known-{Path(python).parent.parent.name}.json"
    subprocess.run([python, "-m", "fuzzshard", "known", "--check", "--json", str(out)], check=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", help="files `fuzzshard known --check --json` wrote")
    ap.add_argument("--run", action="append", default=[], metavar="PYTHON",
                    help="run `known --check` with this interpreter first (repeatable)")
    ap.add_argument("--keep", default=None, help="where --run keeps its result files (default: a temp folder)")
    args = ap.parse_args(argv)
    keep = Path(args.keep or tempfile.mkdtemp(prefix="known-table-"))
    keep.mkdir(parents=True, exist_ok=True)
    results = [json.loads(Path(p).read_text()) for p in args.results] + [run_check(py, keep) for py in args.run]
    if not results:
        ap.error("no results: give RESULT.json files or --run PYTHON")
    releases = record(results)
    print(f"recorded {', '.join(releases)}; regenerated {KNOWN_DIR / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
