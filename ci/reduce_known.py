#!/usr/bin/env python
"""Re-reduce the known list: each known finding's case made 1-minimal
(fuzzshard/findings/reduce.py) on a warm pool, the smaller case confirmed in fresh
workers, then written back with its new verdict and what the reducer took
out ("removed"). Prints, per finding, its size before and after, and the
median layers and steps of the list before and after.

    python ci/reduce_known.py [--budget 120] [--only SIG ...] [--known DIR]

Hangs are left as they are (each edit could cost the case timeout, and a
known hang is matched by its trigger, not run), and so are findings this
machine cannot run (another device, a plugin) or that no longer give their
signature here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from fuzzshard.findings.record import KNOWN_DIR, load_finding, summary


def layers(case) -> int:
    """Param-holding layers of a topology (an activation holds none), blocks of a decoder."""
    if case.model.factory:
        return int(case.model.sizes.get("n_layers", 1))

    def count(ls):
        return sum(count(x.children) if x.children else x.kind != "act" for x in ls)

    return count(case.model.layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--known", default=str(KNOWN_DIR), help="the known-findings folder (default: fuzzshard's)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of reducing per finding")
    ap.add_argument("--only", nargs="*", help="these signatures only")
    ap.add_argument("--workers", type=int, default=4, help="ranks of the warm pool (default 4)")
    args = ap.parse_args()
    from fuzzshard.findings.judge import judge, judge_many  # (torch: after --help)
    from fuzzshard.findings.reduce import reduce
    from fuzzshard.pool.options import PoolOptions
    from fuzzshard.pool.runner import Pool

    paths = sorted(p for p in Path(args.known).glob("*.json") if p.name != "root_causes.json")
    before, after, rows = [], [], []
    with Pool(args.workers, options=PoolOptions(case_timeout=60), placed=True).start() as pool:
        for path in paths:
            f = load_finding(path)
            if args.only and f.signature not in args.only:
                continue
            case = f.case
            before.append((layers(case), len(case.schedule)))
            skip = ("a hang" if f.verdict.oracle == "hang" or f.trigger else
                    "another device" if case.device != "cpu" or (f.devices and "cpu" not in f.devices) else
                    "a plugin's" if f.environment.get("plugins") else "")
            if not skip and judge(pool, case, {}).label != f.signature:
                skip = "does not give its signature here"
            if skip:
                after.append(before[-1])
                rows.append(f"{f.signature}: left as is ({skip})")
                continue
            t = time.monotonic()
            verdicts: dict = {}

            def keeps(cases, sig=f.signature):
                judged = judge_many(pool, cases, {})
                verdicts.update({c.to_json(): j.verdict for c, j in zip(cases, judged)})
                return [j.label == sig for j in judged]

            small, removed = reduce(case, keeps_bugs=keeps, batch=args.workers, budget_s=args.budget)
            if small.to_json() != case.to_json():
                pool.fresh()
                again = judge(pool, small, {})
                if again.label == f.signature:
                    data = json.loads(path.read_text())
                    data.update(case=small.to_dict(), verdict=again.verdict.to_dict(), removed=f.removed + removed,
                                summary=summary(again.verdict))  # (the copy a reader sees: the new verdict's)
                    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
                else:
                    removed, small = [f"(the reduced case gave {again.label} in fresh workers: kept the old one)"], case
            after.append((layers(small), len(small.schedule)))
            rows.append(f"{f.signature}: layers {before[-1][0]} -> {after[-1][0]}, steps {before[-1][1]} -> "
                        f"{after[-1][1]}, {len(removed)} edit(s) in {time.monotonic() - t:.0f}s: {'; '.join(removed)}")
            print(rows[-1], flush=True)
    for i, what in enumerate(("layers", "steps")):
        print(f"median {what}: {statistics.median(b[i] for b in before)} -> {statistics.median(a[i] for a in after)}; "
              f"with 3 or more: {sum(b[i] >= 3 for b in before)} -> {sum(a[i] >= 3 for a in after)} of {len(before)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
