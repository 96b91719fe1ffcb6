"""`fuzzshard known`: the known torch bugs by root cause; --check replays them, --minimal runs the
hand-reduced scripts."""
from __future__ import annotations

import re

from ..findings.knownlist import counts_text, headline, known_markdown, short_text  # noqa: F401 (ci/gen_docs.py)
from ..findings.releases import regression_table  # noqa: F401 (the table of root cause x release; tests)
from .common import UsageError, check_pool_args, count, pool_args, start_pool, torch_version


def add(sub) -> None:
    k = sub.add_parser("known", help="the known findings in torch, by root cause; --check replays them, "
                                     "--minimal runs the hand-reduced scripts",
                       description="The torch bugs fuzzshard has found (fuzzshard/known/), by root cause: how each "
                       "shows, where it stands upstream, its findings. A session counts a known finding as a known "
                       "hit, not a new one. --check replays every one on this torch; --minimal runs the "
                       "hand-reduced scripts.")
    k.add_argument("--check", action="store_true", help="replay each and say whether it still reproduces; exit 0 "
                   "when every one is as recorded (reproduces, or cannot run here), 1 when one is fixed or fails "
                   "differently")
    k.add_argument("--markdown", action="store_true", help="print the list as a Markdown table (known/README.md)")
    k.add_argument("--sample", type=count, metavar="N", help="with --check: only N root causes, one finding each "
                   "(the smallest cases on at most 2 ranks): a quick check of another torch (ci/version_smoke.sh)")
    k.add_argument("--json", metavar="FILE", help="with --check: also write each signature's outcome on this torch "
                   "to FILE (ci/known_table.py joins several releases' files into the known README's table)")
    k.add_argument("--minimal", nargs="*", metavar="ROOT_CAUSE",
                   help="run the hand-reduced scripts of these root causes (none named: all) under torchrun here and "
                        "say, per root cause, whether each still reproduces (a quick check of another torch version)")
    pool_args(k, runs="known")


def run(args) -> int:
    from ..findings.record import load_known
    from ..findings.judge import judge
    from ..findings.rootcause import load_root_causes

    if (args.sample or args.json) and not args.check:
        raise UsageError(f"{'--sample' if args.sample else '--json'} goes with --check (it says what a check replays "
                         "or writes)")
    known = load_known()
    if not known:
        print("no known findings")
        return 0
    if args.markdown:
        print(known_markdown(known))
        return 0
    if args.check and args.sample:
        known = _sample(known, args.sample, args.device or "cpu")
    causes = load_root_causes(known)
    if args.minimal is not None:
        return _check_minimal(causes, args.minimal)
    pool = None
    if args.check:
        check_pool_args(args)
        here = [f for f in known.values() if f.case.device == args.device]
        if here:
            ranks = max(f.case.ranks for f in here)
            if args.device == "cuda":
                import torch

                ranks = min(ranks, torch.cuda.device_count())
            pool = start_pool(args, ranks)
    print(f"{headline(known, causes)} (--markdown: the table with upstream states; `fuzzshard show "
          f"fuzzshard/known/SIG.json`: one finding)", flush=True)
    outcome: dict[str, list] = {}
    each: dict[str, str] = {}  # signature -> reproduces / fixed / differs (SIG) / skipped, for --json
    try:
        order = [(rc.id, rc.signatures) for rc in sorted(causes.values(), key=lambda rc: rc.id)]
        order += [("", [sig for sig, f in sorted(known.items()) if not f.root_cause])]
        for rid, sigs in order:
            if not sigs and not rid:
                continue
            rc = causes.get(rid)
            print(f"\n{rid} · {rc.kind} · {rc.upstream_text}\n    {rc.title}" if rc else "\n(no root cause recorded)",
                  flush=True)
            if rc and not sigs:  # counted in the headline: listed too
                print("    (no finding of its own" + (f": `fuzzshard known --minimal {rid}` runs its hand-reduced "
                                                          "script)" if rc.minimal else ")"), flush=True)
            for sig in sigs:
                f, status = known[sig], ""
                if pool is not None:
                    if f.case.device != args.device or f.case.ranks > pool.size:
                        status = "skipped"
                    else:
                        got = judge(pool, f.case).label
                        status = "reproduces" if got == f.signature else "fixed" if got == "pass" else f"differs ({got})"
                    outcome.setdefault(rid or sig, []).append(status)
                    each[sig] = status
                print(f"    {sig}" + (f"  {status}" if status else "") + ("" if rc else f"\n        {f.diagnosis}"),
                      flush=True)
    finally:
        if pool is not None:
            pool.close()
    if args.check and args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps({"torch": torch_version(), "device": args.device, "results": each},
                                              indent=1, sort_keys=True) + "\n")
    if outcome:
        print(f"\nroot cause on torch {torch_version()}, {args.device}: still reproduces / fixed / now fails differently"
              f" / skipped (signatures)")
        for rid, got in outcome.items():
            n = {k: sum(1 for g in got if g.split(" ")[0] == k) for k in ("reproduces", "fixed", "differs", "skipped")}
            verdict = ("still reproduces" if n["reproduces"] else "FIXED" if n["fixed"] else
                       "NOW FAILS DIFFERENTLY" if n["differs"] else "skipped")
            print(f"  {rid:55} {verdict:22} {n['reproduces']} / {n['fixed']} / {n['differs']} / {n['skipped']}")
    # 0: every finding checked is as recorded (it reproduces, or could not run here); 1: something differs
    return int(any(not (v == "reproduces" or v == "skipped") for v in each.values()))


def _sample(known: dict, n: int, device: str) -> dict:
    """One finding of each of ``n`` root causes: per root cause its smallest case on ``device`` on at most 2
    ranks that runs (no hang trigger: a known hang is counted without running), the cheapest root causes first."""
    best: dict = {}
    for sig, f in sorted(known.items()):
        if f.root_cause and not f.trigger and f.case.device == device and f.case.ranks <= 2:
            size = len(f.case.to_json())
            if f.root_cause not in best or size < best[f.root_cause][0]:
                best[f.root_cause] = (size, sig)
    chosen = sorted(best.values())[:n]
    return {sig: known[sig] for _, sig in chosen}


def _check_minimal(causes: dict, only: list) -> int:
    """Each root cause's hand-reduced script, run here: exit 1 (and BUG REPRODUCED) is the bug."""
    from ..report.upstream import run_minimal

    unknown = sorted(set(only) - set(causes))
    if unknown:
        raise UsageError(f"unknown root cause(s) {', '.join(unknown)} (see `fuzzshard known`)")
    chosen = [rc for rid, rc in sorted(causes.items()) if rc.minimal and (not only or rid in only)]
    print(f"hand-reduced scripts of {len(chosen)} root causes on torch {torch_version()}: a failing exit with a "
          f"'BUG' line = still reproduces, 0 = does not, else fails otherwise (a script may need a GPU: it says so "
          f"at its top; an uncaught exception exits 1 too, without the line)", flush=True)
    for rc in chosen:
        code, printed = run_minimal(rc)
        verdict = ("DOES NOT REPRODUCE" if code == 0 else "still reproduces" if re.search(r"\bBUG\b", printed)
                   else f"fails otherwise (exit {code})")
        last = printed.strip().splitlines()[-1:] or [""]
        print(f"  {rc.id:55} {verdict:30} {last[0][:80]}", flush=True)
    return 0
