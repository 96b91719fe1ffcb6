"""``fuzzshard bench --hunt``'s flags, and ``python -m fuzzshard.cli.hunt``: the same hunt without the rest
of bench and without fuzzshard's CLI (the cap read here), to time another tree's search from a copy of it
(docs/search.md). The hunt itself is session/hunt.py's."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..duration import parse_duration
from ..session import hunt
from ..session.hunt import DEFAULT_CAP, DEFAULT_SEEDS, DEFAULT_SET, load_set, pick, run_hunt


def add_arguments(p) -> None:
    """bench's --hunt options (cli/bench.py adds them to bench)."""
    p.add_argument("--hunt", action="store_true",
                   help="instead: time to first finding of each planted bug in a hunt set, over --hunt-seeds, one "
                        "table with the median and the worst (docs/search.md)")
    p.add_argument("--bugs", default=None, metavar="NAMES",
                   help="--hunt: only these planted bugs of the set, comma-separated (a name's prefix will do)")
    p.add_argument("--hunt-seeds", default=",".join(map(str, DEFAULT_SEEDS)), metavar="SEEDS",
                   help="--hunt: the session seeds, comma-separated (default 1,2,3)")
    p.add_argument("--cap", default=f"{DEFAULT_CAP:.0f}s", metavar="DURATION",
                   help=f"--hunt: stop a session not done in this long; the bug counts as not seen (default {DEFAULT_CAP:.0f}s)")
    p.add_argument("--hunt-set", default=str(DEFAULT_SET), metavar="FILE.json",
                   help="--hunt: the set of planted bugs (default tests/planted/hunt.json, in fuzzshard's source tree: "
                        "a checkout installed with pip install -e .)")


def _asked(args) -> tuple[Path, list, list[int]]:
    """The set's folder, the bugs picked from it and the seeds, as the flags say."""
    folder, bugs = load_set(args.hunt_set)
    return folder, pick(bugs, args.bugs), [int(s) for s in str(args.hunt_seeds).split(",") if s.strip()]


def run(args, read_duration) -> int:
    """bench --hunt (cli/bench.py), its cap read by ``read_duration`` (the CLI's, whose errors are usage errors)."""
    folder, bugs, seeds = _asked(args)
    run_hunt(bugs, folder, seeds, read_duration(args.cap))
    return 0


def main(argv=None) -> int:
    """``python -m fuzzshard.cli.hunt``: the same as ``fuzzshard bench --hunt``."""
    ap = argparse.ArgumentParser(prog="fuzzshard bench --hunt", description=hunt.__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    folder, bugs, seeds = _asked(args)
    cap = parse_duration(args.cap, "--cap")
    rows = run_hunt(bugs, folder, seeds, cap, echo=lambda *a, **k: print(*a, **{"flush": True, **k}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
