"""One release's run of `fuzzshard bisect` (findings/releases.py drives it): ``python -m
fuzzshard.cli.release_run --json OUT [pool flags] FILE...`` in that release's venv python, with this tree's
fuzzshard on PYTHONPATH; every file replayed on one warm pool, as `known --check` does, and each one's outcome
written to OUT."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import UsageError, check_pool_args, load_file, pool_args, start_pool, torch_version


def replay_here(paths: list[str], args) -> dict:
    """{"torch", "device", "results": {path: outcome}, "notes": {path: what went wrong}}: each file replayed
    on one pool (big enough for the largest case), as `known --check` does."""
    from ..findings.judge import judge

    findings, notes, results = {}, {}, {}
    for p in paths:
        try:
            findings[p] = load_file(p)
        except UsageError as e:  # a file this release's fuzzshard cannot read: that release's verdict
            results[p], notes[p] = "differs (error)", str(e)
    here = {p: f for p, f in findings.items() if f.case.device == args.device}
    results.update({p: "skipped" for p in findings if p not in here})
    pool = start_pool(args, max(f.case.ranks for f in here.values())) if here else None
    try:
        for p, f in here.items():
            j = judge(pool, f.case)
            got = j.label
            if j.verdict.status in ("error", "invalid"):
                notes[p] = str(j.verdict.error or j.verdict.extra.get("reason", ""))[:300]
            results[p] = ("reproduces" if got == f.signature else "fixed" if got == "pass" else f"differs ({got})")
            print(f"  {results[p]:12} {p}", flush=True)
    finally:
        if pool is not None:
            pool.close()
    return {"torch": torch_version(), "device": args.device, "results": results, "notes": notes}


def main(argv=None) -> int:
    """The per-release run: ``python -m fuzzshard.cli.release_run --json OUT [pool flags] FILE...``."""
    ap = argparse.ArgumentParser(prog="python -m fuzzshard.cli.release_run", description=main.__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", required=True)
    pool_args(ap)
    args = ap.parse_args(argv)
    check_pool_args(args)
    Path(args.json).write_text(json.dumps(replay_here(args.files, args), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
