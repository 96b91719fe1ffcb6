#!/usr/bin/env python3
"""Record the suite's slow tests' times in tests/data/durations.json, from a full run's pytest log.

The default tier starts its longest tests first (tests/conftest.py orders the collection by these times, and
pyproject's addopts hand tests to pytest-xdist's two workers one at a time, `--dist load --maxschedchunk 1`),
so that no long test starts last and runs alone at the end. A test not in the file counts as short.

usage: python -m pytest --durations=0 ... | tee LOG;  python ci/durations.py LOG [--min SECONDS] [--load N]
  LOG        a pytest log with a --durations table (setup, call and teardown of a test are summed);
             several logs: the largest time of each test is kept
  --min      record only tests that took at least this long (default 5 s: below it, the order hardly matters)
  --load     the machine's load average during the run, written beside the times (they are relative)
  --check    print the recorded times beside the log's, write nothing
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "data" / "durations.json"
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(?:\S*/)?(test_[^/\s]*\.py::.*?)\s*$")


def read(paths) -> dict:
    """Each test's seconds (setup + call + teardown) in the logs; the largest over the logs."""
    best = {}
    for path in paths:
        got = {}
        for line in Path(path).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                got[m[3]] = got.get(m[3], 0.0) + float(m[1])
        for k, v in got.items():
            best[k] = max(best.get(k, 0.0), v)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min", type=float, default=5.0)
    ap.add_argument("--load", default="")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    times = {k: round(v, 1) for k, v in read(a.logs).items() if v >= a.min}
    if not times:
        print("no --durations table in the log(s)", file=sys.stderr)
        return 2
    if a.check:
        old = json.loads(TABLE.read_text())["seconds"] if TABLE.exists() else {}
        for k in sorted(set(times) | set(old), key=lambda k: -times.get(k, old.get(k, 0))):
            print(f"{old.get(k, '-'):>8} {times.get(k, '-'):>8}  {k}")
        return 0
    about = ("Seconds per test (setup + call + teardown) of the default tier's slow tests in one full run "
             f"(-n 2{', load average ' + a.load if a.load else ''}), written by ci/durations.py: tests/conftest.py "
             "starts the longest first; a test not here counts as short. Relative, not a budget.")
    TABLE.write_text(json.dumps({"about": about, "seconds": dict(sorted(times.items(), key=lambda kv: -kv[1]))},
                                indent=1) + "\n")
    print(f"{len(times)} tests at {a.min:g} s or more, {sum(times.values()):.0f} s in all: {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
