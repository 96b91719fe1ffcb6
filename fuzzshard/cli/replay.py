"""`fuzzshard replay`: re-run a finding or case file in fresh workers."""
from __future__ import annotations

import argparse
import os
import sys

from .common import (
    FILE_HELP, UsageError, check_gpus, check_pool_args, load_file, pool_args, raw_finding, recorded_plugins,
    start_pool,
)


def add(sub) -> None:
    r = sub.add_parser("replay", help="re-run a finding or case file: exit 0 passes now, 1 still fails with the "
                       "recorded signature, 3 fails with another, 2 bad file",
                       description="Re-run a finding or case file in fresh workers, on the device it was recorded on.\n"
                       "Exit 0: passes now; 1: fails with the recorded signature (the same bug); 3: fails with "
                       "another signature (both are printed); 2: unreadable or invalid file.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("file", help=FILE_HELP)
    pool_args(r, runs="recorded")


def run(args) -> int:
    from ..findings.record import summary
    from ..findings.judge import judge

    recorded = raw_finding(args.file)
    # the plugins the finding was found with (its optimizer, model or parallelism) load again, wherever they still are
    args.plugin = (args.plugin or []) + recorded_plugins(recorded.get("environment"), args.plugin or [])
    # a case replays where it was found, unless told otherwise
    check_pool_args(args, device=recorded.get("case", {}).get("device"))
    from ..pool.zygote import prestart

    prestart()  # the workers' imports beside this process's (load_file imports torch)
    finding = load_file(args.file)
    case = finding.case
    if args.device != case.device:
        print(f"note: {args.file} was recorded on {case.device}; replaying on {args.device}", file=sys.stderr)
    simulated = _simulated(args, recorded, case)
    if not simulated:
        check_gpus(args, case.ranks)
    pool = start_pool(args, 1 if simulated else case.ranks)
    try:
        j = judge(pool, case)
    finally:
        pool.close()
    v, sig = j.verdict, j.signature
    if v.status == "invalid":
        raise UsageError(f"{args.file}: the case is invalid: {v.extra['reason']}")
    if v.status == "error":
        raise UsageError(f"{args.file}: fuzzshard could not run the case: {v.error}")
    if v.status == "pass":
        print(f"PASS: {args.file} no longer fails" + (f" ({finding.signature})" if finding.signature else ""))
        return 0
    if finding.signature and sig != finding.signature:
        print(f"FAILS DIFFERENTLY: {sig}\n  recorded: {finding.signature}\n  now:      {sig}\n{summary(v)}")
        return REPLAY_DIFFERENT
    print(f"FAIL: {sig}\n{summary(v)}")
    for m in (v.mismatches or [])[1:]:
        print(f"  also: {m.quantity} {m.fqn} step {m.step}: {m.detail}")
    return 1


def _simulated(args, recorded: dict, case) -> bool:
    """Whether the case replays simulated (LocalTensorMode, as ``fuzz --simulate`` runs it): more ranks than
    real processes run here (real.REAL_MAX), or a file marked simulated only (never run on real processes;
    FUZZSHARD_REAL_MAX admits its world size explicitly). One it cannot simulate is refused in one line (exit 2),
    never started as that many real processes."""
    from ..findings import real  # the real-process limit (REAL_MAX)
    from ..findings.record import Stage
    from ..kernel.simulated import cannot_simulate

    marked = Stage.SIMULATED_ONLY in (recorded.get("stage"), (recorded.get("simulation") or {}).get("status"))
    if args.device != "cpu" or not (case.ranks > real.REAL_MAX or (marked and real.REAL_MAX_ENV not in
                                                                        os.environ)):
        return False
    why = cannot_simulate(case)
    if why:
        raise UsageError(f"{args.file}: {case.ranks} ranks, more than the {real.REAL_MAX} real processes this "
                         f"machine runs ({real.REAL_MAX_ENV}), and it cannot replay simulated: {why}")
    print(f"note: {args.file}: replaying simulated ({case.ranks} ranks in one process under LocalTensorMode, as "
          f"fuzz --simulate ran it): " + (f"more than the {real.REAL_MAX} real processes this machine runs"
                                          if case.ranks > real.REAL_MAX else "the file is marked simulated only"),
          file=sys.stderr)
    args.simulate = True
    return True


REPLAY_DIFFERENT = 3  # exit code: the case fails, with another signature than the one recorded

