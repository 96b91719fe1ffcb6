"""`fuzzshard fuzz`: one fuzz session, and the summary it prints at the end."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
import random
import sys

from .common import (
    WORLD_SIZES, Renamed, UsageError, check_gpus, check_pool_args, count, draw_args, out_dir, parse_duration,
    parse_world_sizes, pool_args, redis_url, resolve_targets, start_pool, draws as read_draws, torch_version, warn_cores,
    whole,
)


def add(sub) -> None:
    f = sub.add_parser("fuzz", help="run a fuzz session", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Draw cases, run each sharded and as an anchored reference, shrink every "
                       "divergence and write OUT/<signature>.json + .py.\nExit 0: no new finding; 1: new findings; 2: usage error.")
    from ..targets import names as target_names  # the registry imports no torch

    f.add_argument("--target", default="dtensor", metavar="TARGET",
                   help=f"target name(s), comma-separated, or 'all': {', '.join(target_names())} (default: dtensor)")
    f.add_argument("--targets", dest="target", action=Renamed, new="--target", help=argparse.SUPPRESS)
    g = f.add_mutually_exclusive_group()
    g.add_argument("--max-examples", type=count, default=None, metavar="N", help="cases to draw per target (default 100)")
    g.add_argument("--duration", help="search for this long instead, e.g. 90s, 10m, 8h; the session may run past it "
                                      "by --shrink-budget at most, to make what its last round found 1-minimal, and "
                                      "by a tenth of it (at least 20s) to confirm its findings")
    f.add_argument("--seed", type=whole, default=None, metavar="N",
                   help="the seed of the cases drawn (default: a random one, printed, so that repeated sessions explore)")
    f.add_argument("--out", default="fuzzshard-out", metavar="DIR",
                   help="findings and the example database go here (default: fuzzshard-out)")
    f.add_argument("--shrink-budget", default=None, metavar="DURATION",
                   help="once a round finds something, Hypothesis searches and shrinks for a third of this at "
                        "most; then the reducer has this long to edit the round's findings to 1-minimal (it drops "
                        "the checkpoint, the scaler, the scheduler, the clip, ranks, layers, ...), right after the "
                        "round and past --duration if need be; a finding it cuts short says so ('not 1-minimal') "
                        "(default: a quarter of --duration, at least 30s, at most 5m; 5m with --max-examples)")
    f.add_argument("--redis", default=None, metavar="URL",
                   help="share the example database through redis (redis://host:port/db); OUT/.hypothesis is "
                        "written too, and used alone if the server goes away")
    f.add_argument("--one-at-a-time", action="store_true",
                   help="run one case at a time. By default, cases that need fewer ranks than the pool are drawn "
                        "in packs and run side by side on disjoint ranks, so a world-size-1 case does not leave "
                        "three ranks waiting (2.5x the cases/s of a session over world sizes 1-4 here); a packed "
                        "session draws other cases than one at a time with the same seed")
    f.add_argument("--simulate", action="store_true",
                   help="run each case's ranks in one process under torch's LocalTensorMode (a fake process "
                        "group), one case per worker side by side: world sizes up to 64 and 3-dim meshes "
                        "(default --world-sizes 5,6,7,8,12,16,32,64); each finding is then re-run on real gloo "
                        "processes at its shrunk world size where that fits (<= 8), and one that does not fail "
                        "there goes to OUT/simulation_limits/, never a finding (docs/simulate.md)")
    draw_args(f)
    pool_args(f)


def run(args) -> int:
    import signal

    workers, simulated = _simulate(args) if args.simulate else (0, {})
    sizes = parse_world_sizes(args.world_sizes or WORLD_SIZES)
    duration = parse_duration(args.duration, "--duration") if args.duration else None
    shrink_budget = parse_duration(args.shrink_budget, "--shrink-budget") if args.shrink_budget else None
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError("--max-examples must be >= 1")
    check_pool_args(args)
    check_gpus(args, 1 if args.simulate else max(sizes))
    names = resolve_targets(args.target)
    from ..pool.zygote import prestart

    prestart()  # the workers' imports beside this process's (the session's and the strategies' import torch)
    from ..session.engine import Session
    from ..session.options import SessionOptions

    draws = read_draws(args, names, sizes, **simulated)
    from .. import targets

    if args.compile and not any(targets.get(n).spec.compiled for n in names):
        compiling = [n for n in targets.names() if targets.get(n).spec.compiled]
        raise UsageError(f"--compile: none of {', '.join(names)} draws torch.compile (these do: {', '.join(compiling)})")
    database = redis_url(args.redis) if args.redis else None
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    out_dir(args.out)
    warn_cores(1 if args.simulate else max(sizes))
    print(f"fuzzshard: targets {','.join(names)} · world sizes {sizes} · seed {seed} · out {args.out}", file=sys.stderr)
    session = None
    stops = []

    def stop(signum, frame):
        """The first signal ends the session after its current case; a second one at once."""
        stops.append(signum)
        name = signal.Signals(signum).name
        if session is None or len(stops) > 1:
            raise KeyboardInterrupt(name)
        session.request_stop(name)
        print(f"\nfuzzshard: {name}: stopping after the current case (again to stop at once)", file=sys.stderr,
              flush=True)

    # explicit handlers: a shell starts a background job with SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    pool = start_pool(args, workers if args.simulate else max(sizes), log_dir=os.path.join(args.out, "logs"),
                      spare=True, placed=not args.one_at_a_time)
    try:
        make = Session
        if args.simulate:  # its book sets LocalTensor's own errors aside unshrunk, for the real check (simulate.py)
            from ..session.simulate import SimulatedSession as make
        options = SessionOptions(out=args.out, max_examples=args.max_examples or 100, duration=duration, seed=seed,
                                 shrink_budget=shrink_budget, database=database, plugins=tuple(args.plugin or ()),
                                 pack=pool.size if args.simulate and not args.one_at_a_time else None)
        session = make(pool, draws, options)
        session.log = Path(args.out, "cells", "fuzz.jsonl")  # a line per case: `fuzzshard report OUT` reads them
        session.log.parent.mkdir(parents=True, exist_ok=True)
        if session.pack > 1:
            print(f"fuzzshard: cases drawn in packs of up to {session.pack}, run side by side on disjoint ranks of "
                  f"{pool.size} (--one-at-a-time: one at a time)", file=sys.stderr)
        try:
            session.run()
        except KeyboardInterrupt:  # the second signal: every finding seen is on disk already
            print("fuzzshard: stopped at once; the finding files are as they were", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # closing the pool is not to be interrupted
        pool.close()
    findings = list(session.findings.values())
    set_aside = getattr(session.book, "set_aside", None) if session else None
    if args.simulate and (findings or set_aside):  # a simulated finding is one only once real processes fail the same way
        from ..findings.life import confirm_on_real
        from ..pool.runner import PoolError
        from ..session.simulate import CheckPools

        try:  # on pools made from the session's own options, simulated and real
            found = confirm_on_real(findings, args.out, CheckPools(pool.options, workers), set_aside=set_aside,
                                    optimizer_names=draws.strategy_kwargs().get("optimizer_names")).get("found", [])
        except PoolError as e:
            raise UsageError(f"could not start the workers that check the simulated findings: {e}") from None
        findings = [f for f in findings + found if os.path.exists(os.path.join(args.out, f"{f.signature}.json"))]
    _print_session_report(session, findings, args.out)
    if findings:
        return 1
    return 128 + stops[0] if stops else 0


def _simulate(args) -> tuple[int, dict]:
    """``fuzz --simulate``: its checks, and its defaults into the flags not given (session/simulate.py's: world
    sizes 5-64, no checkpoints, a longer case timeout); (the workers of its pool, the draws it adds)."""
    from ..session.simulate import (
        DEFAULT_WORLD_SIZES, SIMULATED_CASE_TIMEOUT, SIMULATED_TARGETS, available, simulated_draws, simulated_workers,
    )

    why = available()
    if why:
        raise UsageError(f"--simulate: {why}")
    if (args.device or "cpu") != "cpu":
        raise UsageError("--simulate runs on CPU (LocalTensorMode over a fake process group)")
    names = resolve_targets(args.target)
    if args.target == "all":
        names = [n for n in names if n in SIMULATED_TARGETS]
        args.target = ",".join(names)
    other = [n for n in names if n not in SIMULATED_TARGETS]
    if other:
        raise UsageError(f"--simulate runs {', '.join(SIMULATED_TARGETS)}; not {', '.join(other)} "
                         "(docs/simulate.md says why)")
    if args.checkpoints == "all":
        raise UsageError("--simulate draws no checkpoints: torch.save, broadcast_from_rank0 and DCP of LocalTensors "
                         "fail under LocalTensorMode (docs/simulate.md)")
    if args.checkpoints == "some":  # the default: said, not silent
        print("fuzzshard: --simulate: no checkpoints (saving and loading LocalTensors is not simulated: "
              "docs/simulate.md)", file=sys.stderr)
        args.checkpoints = "none"
    if args.world_sizes is None:  # not given: a simulated session is for the sizes a pool cannot reach
        args.world_sizes = DEFAULT_WORLD_SIZES
    if args.case_timeout is None:  # not given: a simulated case runs its W ranks one after the other
        args.case_timeout = SIMULATED_CASE_TIMEOUT
    return simulated_workers(), simulated_draws(names)


def _print_session_report(session, findings, out) -> None:
    st = session.stats
    again = f" · {st.repeats} drawn again, answered without a run" if st.repeats else ""
    print(f"\n{st.cases} cases · {st.valid} valid · {st.invalid} invalid{again} · {st.rate():.2f} cases/s",
          file=sys.stderr)
    length = f"session {session.elapsed:.0f}s"
    if session.duration:  # its bound: the duration, a last round's reduction, the grace (Session.overrun)
        length += (f" (--duration {session.duration:.0f}s, a last round's reduction {session.shrink_budget:.0f}s at "
                   f"most, grace {session.grace():.0f}s)")
    if session.stop_reason:
        length += f", stopped by {session.stop_reason}"
    print(length, file=sys.stderr)
    pool = session.pool
    if pool.restarts:  # what hangs, crashes and ranks stuck after another rank raised cost the session
        print(f"pool restarts: {pool.restarts} ({pool.stuck_seconds:.0f}s waiting for ranks stuck after another "
              f"raised, {pool.restart_seconds:.0f}s restarting)", file=sys.stderr)
    if st.derived_timeouts or st.slow:
        print(f"while a hang shrank: {st.derived_timeouts} case(s) ran under a derived timeout of "
              f"{st.derived_timeout:.0f}s (--case-timeout {session.pool.case_timeout:.0f}s); {st.slow} provisional "
              f"hang(s) finished at the full timeout (slow, not hung)", file=sys.stderr)
    if st.passed_by_optimizer:
        by = st.passed_by_implementation
        cover = ", ".join(f"{k} {v} ({'·'.join(str(by[k, i]) for i in ('forloop', 'foreach', 'fused'))})"
                          for k, v in sorted(st.passed_by_optimizer.items()))
        print(f"passing cases by optimizer (for-loop·foreach·fused): {cover}", file=sys.stderr)
    for title, cells in st.passed_coverage.items():  # what the targets say their cases covered (Spec.coverage)
        print(f"passing {title}: {', '.join(f'{k} {v}' for k, v in cells.most_common())}", file=sys.stderr)
    from ..findings.rootcause import grouped

    matcher = session.matcher
    stage = {"confirmed": "", "shrinking": " (shrunk in warm workers, not yet re-run fresh: `fuzzshard replay` it)",
             "unconfirmed": " (UNCONFIRMED: no time was left to re-run it in fresh workers)",
             "provisional": " (PROVISIONAL hang: it hung under a limit derived from passing cases; no time was left "
                            "to confirm it at --case-timeout in fresh workers: `fuzzshard replay` it)",
             "simulated only": " (SIMULATED ONLY: more ranks than this machine runs for real, so never run on real "
                               "process groups: docs/simulate.md)"}
    groups = grouped(findings, matcher)
    for key, members in groups.items():  # new findings first: what the user came for
        if len(groups) > 1 or len(members) > 1 or key.startswith("root cause"):
            print(f"{key}: {len(members)} finding(s)", file=sys.stderr)
        for f in members:
            _print_finding(f, out, stage.get(f.stage, ""), st.folded.get(f.signature, 0),
                           getattr(session.book, "met_again", {}).get(f.signature, 0))
    for c in session.contaminated:
        print(f"CONTAMINATED (a fuzzshard internal error, not a finding): {c['signature']} in warm workers, "
              f"{c['fresh_signature']} in fresh ones, after {len(c['ran_before_in_that_generation'])} other case(s)"
              f"\n        -> {out}/contaminated/{c['signature']}.json", file=sys.stderr)
    for c in session.unsteady:
        print(f"UNSTEADY (not a finding: the case's outcome varies between fresh runs): {c['signature']}, then "
              f"{c['fresh_signature']}\n        -> {out}/unsteady/{c['signature']}.json", file=sys.stderr)
    if st.internal_errors:
        print(f"{st.internal_errors} fuzzshard-internal errors, not findings (see above; cases in {out}/internal/)",
              file=sys.stderr)
    by_cause: dict[str, list] = {}
    for sig, n in sorted(st.known.items()):  # known hits under their root cause: one bug, one line
        by_cause.setdefault(session.known[sig].root_cause or sig, []).append((sig, n))
    for cause, hits in sorted(by_cause.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        rc = matcher.causes.get(cause)
        n = sum(k for _, k in hits)
        faces = f", {len(hits)} signatures" if len(hits) > 1 else ""
        fixed = rc.fixed_after(torch_version()) if rc else ""  # a bug of this release that a later one fixed
        print(f"known   {cause} ×{n}{faces} [{rc.upstream_text}{'; ' + fixed if fixed else ''}]" if rc
              else f"known   {cause} ×{n}", file=sys.stderr)
        for sig, k in hits:  # a new signature known by its address (life.py): named, with the op it met
            if session.known[sig].stage == "known by address":
                print(f"        {sig} ×{k}, {session.known[sig].diagnosis}", file=sys.stderr)
    if findings:
        faces = sum(1 + len(f.faces) for f in findings)
        print(f"{len(findings)} new finding(s), one per bug, under {faces} signature(s); to get there "
              f"{st.generalized} variant run(s) generalized them and {st.reduced_runs} edited run(s) in "
              f"{st.reduce_seconds:.0f}s reduced them", file=sys.stderr)
        _write_index(out, groups, matcher)
    else:
        print("no new findings" + (f" ({sum(st.known.values())} known hits, `fuzzshard known` says what they are)"
                                   if st.known else ""), file=sys.stderr)


def _print_finding(f, out, stage: str, folded: int, again: int = 0) -> None:
    """A new finding: its summary, its other faces, how far the reducer got, what it fails and passes with, its files."""
    from ..findings.record import summary
    from ..findings.generalize import Face, table_text

    print(f"FINDING {f.signature}{stage}\n        {summary(f.verdict)}", file=sys.stderr)
    if f.faces:
        print(f"        one bug, also seen as {', '.join(f.faces)}" + (f" ({folded} case(s) met it so)" if folded else ""),
              file=sys.stderr)
    minimal = _minimal_line(f, again)
    if minimal:
        print(f"        {minimal}", file=sys.stderr)
    if f.generalization:
        table = table_text([Face(**row) for row in f.generalization])
        print("".join(f"        {line}\n" for line in table.splitlines()), end="", file=sys.stderr)
    from ..findings.repro import kind_note

    note = kind_note(f.case, f.environment, f.verdict)  # a fallback to the flattened kernel, and why
    print(f"        -> {out}/{f.signature}.json, {out}/{f.signature}.py (torchrun --nproc-per-node {f.case.ranks}"
          f"{'; ' + note if note else ''})", file=sys.stderr)


def _minimal_line(f, again: int = 0) -> str:
    """Whether the finding is 1-minimal, as its file's ``reduction`` says (life.py), and what the reducer took out;
    a finding of a session before the record: what the reducer took out only."""
    r = f.reduction
    took = ""
    if f.removed:
        took = "the reducer took out " + ", ".join(f.removed[:5]) + \
            (f" and {len(f.removed) - 5} more" if len(f.removed) > 5 else "")
    met = f"; {again} later case(s) met it again, none smaller" if again else ""
    if not r:
        return f"1-minimal: {took}{met}" if took else ""
    runs = f"{r.get('runs', 0)} edited run(s) in {r.get('seconds', 0):.0f}s"
    if r.get("minimal"):
        return f"1-minimal ({runs}): {took or 'no single edit keeps the bug'}{met}"
    if "why" in r:
        return f"not 1-minimal: {r['why']}" + (f"; {took}" if took else "") + met
    return (f"not 1-minimal: reduction stopped after {r.get('seconds', 0):.0f}s, {r.get('untried', '?')} edit(s) "
            f"untried ({r.get('runs', 0)} edited run(s)" + (f"; {took}" if took else "") + f"){met}")


def _write_index(out, groups: dict, matcher) -> None:
    """OUT/INDEX.md: the session's new findings grouped by suspected root cause."""
    from pathlib import Path

    from ..findings.record import atomic_write, summary
    from ..findings.rootcause import address

    lines = ["# New findings by suspected root cause", "",
             "Grouped by what identifies a bug (see fuzzshard/findings/rootcause.py): a group named after a known root "
             "cause has the address of its known findings; a `new:` group is one address no known finding has.", ""]
    for key, members in groups.items():
        lines += [f"## {key}", "", f"address: {address(members[0].case, members[0].verdict)}", ""]
        lines += [f"- [`{f.signature}`]({f.signature}.json) ({f.stage}): {summary(f.verdict)}" for f in members] + [""]
    atomic_write(Path(out) / "INDEX.md", "\n".join(lines))

