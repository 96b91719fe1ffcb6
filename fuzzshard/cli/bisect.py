"""`fuzzshard bisect`: which torch releases have a finding: its replay on every release there is a venv
for, a table, first bad and last good (the work is findings/releases.py's)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .common import FILE_HELP, UsageError, case_timeout, pool_args, pool_flags

HELP = """\
Replay findings on several torch releases, one venv per release, and say which have the bug.

Each release runs in its own venv (the ones ci/version_smoke.sh keeps in --venvs, and the torch of the
python running this); each replays every given finding on one warm pool, as `known --check` does, with
this checkout's fuzzshard. Per finding and release: reproduces (its recorded signature), passes, fails
otherwise (the other signature is printed), or skipped (recorded on CUDA). Then:
  first bad   the oldest release it reproduces on
  last good   the release checked just before that, where it passes
  fixed in    the first release it passes on right after one it reproduced on, and passes after

examples:
  fuzzshard bisect out/dtensor.parity.Adam.param.json              # every cached venv + this python
  fuzzshard bisect out/X.json --torch 2.9.1,2.10.0,2.15.0          # these; a missing venv is made (GBs)
  fuzzshard bisect --known --torch 2.13.0,2.14.1 --record          # the known list; writes its table

Exit 0: the table was made (whatever it says); 2: bad input (an unreadable finding, a release that is not
a torch version, a venv that cannot be made, no venv cached and no --torch: this python's torch alone), one
line."""


def add(sub) -> None:
    b = sub.add_parser("bisect", help="which torch releases have a finding: replay it on each release's venv; "
                       "a table with first bad and last good",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("files", nargs="*", metavar="FINDING.json", help=FILE_HELP)
    b.add_argument("--known", action="store_true", help="every known finding (fuzzshard/known/) as well")
    b.add_argument("--torch", metavar="V[,V..]",
                   help="these releases, e.g. 2.9.1,2.10.0 (a missing venv is made as ci/version_smoke.sh makes it: "
                        "minutes and GBs each); default: every venv in --venvs, and this python's torch")
    b.add_argument("--venvs", default=None, metavar="DIR",
                   help="where the venvs are, one torch-V/ each (default: $VENVS or ~/.cache/fuzzshard/venvs)")
    b.add_argument("--record", action="store_true",
                   help="with --known: write each finding's outcomes into its file (seen_on), each root cause's "
                        "fixed_in into root_causes.json, and regenerate known/README.md's regression table")
    b.add_argument("--json", metavar="FILE", help="also write every release's outcomes and wall time to FILE")
    b.add_argument("--keep", metavar="DIR", help="where the per-release results and logs go (default: a temp folder)")
    pool_args(b, runs="recorded")


def releases_asked(text: str | None, venvs: Path) -> tuple[dict[str, str], list[str]]:
    """(release -> python there now, releases to make). This python's torch counts as a venv of its release."""
    from ..findings import releases
    from ..versions import FLOOR, release

    have = releases.cached(venvs)
    here = releases.release_of(releases_here())
    have.setdefault(here, sys.executable)
    if not text:
        return have, []
    asked = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in asked if not re.fullmatch(r"\d+\.\d+\.\d+", v)]
    if bad or not asked:
        raise UsageError(f"--torch {text!r}: not a list of torch releases like 2.9.1,2.10.0")
    old = [v for v in asked if release(v) < FLOOR]
    if old:
        raise UsageError(f"--torch: {', '.join(old)} is older than fuzzshard's floor, torch {FLOOR[0]}.{FLOOR[1]}")
    return {v: have[v] for v in asked if v in have}, [v for v in asked if v not in have]


def releases_here() -> str:
    from ..versions import installed_torch

    return installed_torch() or ""


def run(args) -> int:
    from ..findings import releases
    from ..findings.knownlist import record_known
    from ..findings.record import KNOWN_DIR, ROOT_CAUSES
    from .common import load_file

    if args.record and not args.known:
        raise UsageError("--record writes the known list's files: give --known")
    paths = [os.path.abspath(p) for p in args.files]
    if args.known:
        paths += [str(p) for p in sorted(KNOWN_DIR.glob("*.json")) if p.name != ROOT_CAUSES]
    if not paths:
        raise UsageError("no finding: give FINDING.json files or --known")
    case_timeout(args)
    signatures = {p: load_file(p).signature for p in paths}  # an unreadable file: one line, exit 2, before any run
    venvs = Path(args.venvs) if args.venvs else releases.VENVS
    pythons, missing = releases_asked(args.torch, venvs)
    if not args.torch and len(pythons) < 2:  # this python's torch alone: one release is no bisection
        raise UsageError(f"no torch venv in {venvs} (--venvs) and no --torch: only this python's torch "
                         f"{', '.join(pythons)} to replay on, which bisects nothing; give --torch V,V,... (a missing "
                         f"venv is made: minutes and GBs each), or --torch {', '.join(pythons)} for this torch alone")
    work = Path(args.keep) if args.keep else releases.scratch()
    work.mkdir(parents=True, exist_ok=True)
    for v in missing:
        print(f"torch {v}: no venv in {venvs}: making one (minutes, GBs)", flush=True)
        try:
            pythons[v] = releases.build(v, venvs, work)
        except RuntimeError as e:
            raise UsageError(str(e)) from None
    flags = pool_flags(args)
    runs = releases.bisect(paths, pythons, flags, work)
    print()
    print("\n".join(releases.table(paths, signatures, runs)))
    if args.json:
        Path(args.json).write_text(json.dumps({"signatures": signatures, "releases": runs}, indent=1,
                                              sort_keys=True) + "\n")
    if args.record:
        done = [{"torch": r["torch"], "results": {signatures[p]: s for p, s in r["results"].items()}}
                for r in runs.values() if not r.get("failed")]
        recorded = record_known(done)
        print(f"recorded {', '.join(recorded)} in the known findings' seen_on, fixed_in in {ROOT_CAUSES}, "
              f"and {KNOWN_DIR / 'README.md'}")
    print(f"results and logs: {work}")
    return 0
