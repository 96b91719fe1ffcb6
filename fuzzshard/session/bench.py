"""``fuzzshard bench``: the warm pool against a fresh process group per case
(what PyTorch's MultiProcessTestCase does) and against the bare training
loop (the floor: the same cases' sharded training alone, in the same pool),
on the same cases, in one run; where a warm case's time goes; and what a
checkpoint round trip adds to a case (the same cases again, each saved after
its first step and resumed, per kind). The last line ends with the speed-up
ratio against a fresh process group. ``bench --simulate``
(``run_simulate_bench``): the same cases simulated in one process
(kernel/simulated.py) against real processes, per world size."""
from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from ..pool.options import PoolOptions
from .options import Draws
from ..pool.runner import Pool


def fixed_cases(n: int, seed: int, draws: Draws) -> list:
    """The same n cases for a given seed, drawn by the fuzzer's own strategy as ``draws`` say (their first
    target, their world sizes, their families), without checkpoints."""
    import fuzzshard.strategies as fst

    kwargs = draws.replace(checkpoint=False).strategy_kwargs()

    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target=draws.targets[0], world_sizes=list(draws.world_sizes), device=draws.device, **kwargs))
    def collect(case):
        if len(out) < n:
            out.append(case)

    collect()
    return out


SPLIT = ("dispatch", "mesh", "sharded", "gathers", "reference", "compare", "checkpoint")
SPLIT_NAMES = {"dispatch": "dispatch", "mesh": "mesh", "sharded": "sharded run", "gathers": "gathers",
               "reference": "reference", "compare": "compare", "checkpoint": "checkpoint"}


HOT_RUNS = 3  # bare and warm again, taken in turn, each this many times: the median of each


def measure(pool, case) -> dict:
    """One case on a warm pool: as a fuzz session runs it (the first time:
    torch's per-shape caches cold, e.g. DTensor's sharding propagation for
    shapes it has not seen), then bare and warm again with those caches
    filled, in turn, ``HOT_RUNS`` times each (a case of 15 ms moves by a few
    ms with the machine's noise; the median of each side does not). Overhead
    is warm / bare with the caches warm on both sides; what the first run
    costs more is torch's, paid by any loop that meets a new shape, so it is
    reported apart, not charged to either side."""
    t0 = time.perf_counter()
    r = pool.run(case)
    row = {"warm": time.perf_counter() - t0}
    row.update(status=r.verdict.status, **{k: r.timings.get(k, 0.0) for k in SPLIT[1:]},
               dispatch=row["warm"] - sum(r.timings.values()))
    hot = {"bare": [], "warm_hot": []}
    for _ in range(HOT_RUNS):
        for key, bare in (("bare", True), ("warm_hot", False)):
            t0 = time.perf_counter()
            pool.run(case, bare=bare)
            hot[key].append(time.perf_counter() - t0)
    row.update({key: statistics.median(times) for key, times in hot.items()})
    return row


def run_bench(n: int, seed: int, draws: Draws, echo=print) -> dict:
    """On the same cases (``draws``: one target, one world size): the warm pool (fuzzshard's case), the bare
    loop in the same pool (the case's sharded training alone: the floor) and a fresh process group per case
    (what a unittest-style harness pays)."""
    target, world, device, models = draws.targets[0], draws.world_sizes[0], draws.device, draws.models or ("topologies",)
    *cases, spare = fixed_cases(n + 1, seed, draws)
    echo(f"bench: {len(cases)} {target} cases ({','.join(models)}) at world size {world} on {device} (seed {seed}): "
         "warm, bare, fresh")

    t0 = time.perf_counter()
    pool = Pool(world, options=PoolOptions(device=device)).start()
    start_s = time.perf_counter() - t0
    try:
        measure(pool, spare)  # the process's own first-call costs (lazy imports, allocator): no case's
        rows = [measure(pool, case) for case in cases]
        restarts, restart_s = pool.restarts, pool.restart_seconds
        from .. import targets

        ckpt_ms = _checkpoint_cost(pool, cases) if targets.get(target).spec.checkpoint_kinds else {}
    finally:
        pool.close()

    t0 = time.perf_counter()
    for case in cases:  # a fresh process group per case: spawn, import torch, init, run, tear down
        fresh = Pool(world, options=PoolOptions(device=device), spare=False, zygote=False).start()
        try:
            fresh.run(case)
        finally:
            fresh.close()
    fresh_s = time.perf_counter() - t0

    k = len(cases)
    total = {key: sum(r[key] for r in rows) for key in ("warm", "bare", "warm_hot")}
    per = {key: 1000 * sum(r[key] for r in rows) / k for key in SPLIT}
    echo(f"verdicts: {dict(collections.Counter(r['status'] for r in rows))}")
    echo(f"warm pool start (once per session): {start_s:.2f}s")
    echo(f"warm per case: {1000 * total['warm'] / k:.0f} ms = "
         + " + ".join(f"{SPLIT_NAMES[key]} {per[key]:.0f}" for key in SPLIT))
    echo(f"  of which torch's first run of new shapes: {1000 * (total['warm'] - total['warm_hot']) / k:.0f} ms "
         f"(the same case again: {1000 * total['warm_hot'] / k:.0f} ms, median of {HOT_RUNS})")
    echo(f"bare per case, shapes seen: {1000 * total['bare'] / k:.0f} ms, median of {HOT_RUNS} (the sharded training alone, same pool: "
         f"build, shard, forward/backward, step)")
    echo(f"pool restarts after hangs/crashes/stuck ranks: {restarts}, {restart_s:.1f}s in all")
    for kind, (ms, n) in ckpt_ms.items():
        echo(f"checkpoint round trip ({kind}): +{ms:.0f} ms per case (save after step 0, fresh model + optimizer, "
             f"load, same world; mean over {n} passing cases)")
    echo(f"fresh per case: {1000 * fresh_s / k:.0f} ms (process spawn + torch import + init_process_group each time)")
    warm_rate, fresh_rate, bare_rate = k / total["warm"], k / fresh_s, k / total["bare"]
    ratio, overhead = warm_rate / fresh_rate, total["warm_hot"] / total["bare"]
    echo(f"cases/s: fresh {fresh_rate:.2f} · warm {warm_rate:.2f} · bare {bare_rate:.2f} (shapes seen)")
    echo(f"overhead vs bare loop: {overhead:.2f}x")
    echo(f"warm pool {warm_rate:.2f} cases/s vs fresh process group {fresh_rate:.2f} cases/s: {ratio:.1f}x")
    return {"warm_rate": warm_rate, "fresh_rate": fresh_rate, "bare_rate": bare_rate, "ratio": ratio,
            "overhead": overhead, "start_s": start_s, "per_case_ms": per,
            "checkpoint_ms": {kind: ms for kind, (ms, _) in ckpt_ms.items()}}


def run_scaling(n: int, seed: int, draws: Draws, echo=print) -> list[dict]:
    """How a case's cost grows: ``n`` cases per world size of ``draws`` on one warm pool
    of max(worlds) ranks, each measured as bench measures it; then the same
    runs by model depth (modules holding params) and by steps."""
    from ..kernel.model import param_shapes

    target, worlds, device = draws.targets[0], draws.world_sizes, draws.device
    pool = Pool(max(worlds), options=PoolOptions(device=device)).start()
    rows = []
    try:
        for w in worlds:
            *cases, spare = fixed_cases(n + 1, seed, draws.replace(world_sizes=(w,)))
            measure(pool, spare)  # first-call costs of this world size (its subgroup, lazy imports)
            for case in cases:
                depth = len({fqn.rsplit(".", 1)[0] for fqn in param_shapes(case.model)})
                rows.append({"world": w, "steps": len(case.schedule), "depth": depth, **measure(pool, case)})
    finally:
        pool.close()
    echo(f"scaling: {target} on {device}, {n} cases per world size (seed {seed}) on one pool of {max(worlds)} ranks; "
         f"cases/s as a session runs them; overhead: warm / bare, shapes seen; the split in ms per case")
    for title, key, bins in (("world size", "world", None), ("depth", "depth", (2, 4, 8)), ("steps", "steps", None)):
        echo(_scaling_table(title, key, bins, rows))
    echo("depth: modules holding params")
    return rows


def _scaling_table(title: str, key: str, bins, rows: list[dict]) -> str:
    def group(v):
        if not bins:
            return str(v)
        lo = 1
        for hi in bins:
            if v <= hi:
                return f"{lo}-{hi}" if lo != hi else str(lo)
            lo = hi + 1
        return f"{lo}+"

    groups = collections.defaultdict(list)
    for row in rows:
        groups[group(row[key])].append(row)
    cols = ["cases", "cases/s", "overhead"] + [SPLIT_NAMES[k] for k in SPLIT]
    lines = [f"{title:>10} | " + " | ".join(f"{c:>11}" for c in cols)]
    for g in sorted(groups, key=lambda g: int(g.split("-")[0].rstrip("+"))):
        rs = groups[g]
        warm, hot, bare = (sum(r[k] for r in rs) for k in ("warm", "warm_hot", "bare"))
        cells = [str(len(rs)), f"{len(rs) / warm:.2f}", f"{hot / bare:.2f}x"]
        cells += [f"{1000 * sum(r[k] for r in rs) / len(rs):.0f}" for k in SPLIT]
        lines.append(f"{g:>10} | " + " | ".join(f"{c:>11}" for c in cells))
    return "\n".join(lines)


def _checkpoint_cost(pool, cases) -> dict:
    """kind -> (mean extra ms, cases): each case run again without and then
    with a round trip after its first step, back to back (the first pass's
    times carry cold-start costs, so they are no fair baseline)."""
    from .. import targets
    from ..case import Checkpoint

    out = {}
    kinds = [k for k in targets.get(cases[0].target).spec.checkpoint_kinds if k != "broadcast"]  # reads what full writes
    for kind in kinds:
        extra = []
        for case in cases:
            ck = Checkpoint(after=0, kind=kind, world_size=case.world_size, mesh_shape=case.mesh_shape,
                            target_options=case.target_options, split=True, strict=False)
            plain = pool.run(case)
            restarts = pool.restarts
            with_ck = pool.run(dataclasses.replace(case, checkpoint=ck))
            if pool.restarts != restarts:  # it crashed (a known bug): warm the new workers before the next pair
                pool.run(case)
            elif plain.verdict.status == with_ck.verdict.status == "pass":
                extra.append(with_ck.seconds - plain.seconds)
        if extra:
            out[kind] = (1000 * sum(extra) / len(extra), len(extra))
    return out


def run_soak_bench(seconds: float, workers: int, target: str, seed: int = 0, echo=print) -> float:
    """A ``workers``-rank soak (cells re-drawn three times) against one fuzz
    session on a pool of ``workers`` ranks, each for ``seconds`` of wall time,
    start-up included; returns soak cases/s over session cases/s."""
    import subprocess
    import sys
    import tempfile
    from .caselog import load_cases

    base = [sys.executable, "-m", "fuzzshard"]
    worlds = ",".join(str(w) for w in range(1, workers + 1))
    with tempfile.TemporaryDirectory(prefix="fuzzshard-bench-") as tmp:
        t0 = time.perf_counter()
        r = subprocess.run(base + ["fuzz", "--target", target, "--duration", f"{seconds}s", "--world-sizes", worlds,
                                   "--seed", str(seed), "--out", f"{tmp}/fuzz"], capture_output=True, text=True)
        fuzz_s = time.perf_counter() - t0
        fuzz_cases = int(next(line for line in r.stderr.splitlines() if " cases · " in line and "valid" in line).split()[0])
        t0 = time.perf_counter()
        subprocess.run(base + ["soak", "--target", target, "--duration", f"{seconds}s", "--epoch", f"{seconds / 3:.0f}s",
                              "--workers", str(workers), "--world-sizes", worlds, "--seed", str(seed),
                              "--out", f"{tmp}/soak"], capture_output=True, text=True)
        soak_s = time.perf_counter() - t0
        cases = load_cases(Path(tmp, "soak"))
        mix = collections.Counter(c["world"] for c in cases)
    fuzz_rate, soak_rate = fuzz_cases / fuzz_s, len(cases) / soak_s
    echo(f"one fuzz session on {workers} ranks: {fuzz_cases} cases in {fuzz_s:.0f}s = {fuzz_rate:.2f} cases/s")
    echo(f"soak, {workers} ranks in cells: {len(cases)} cases in {soak_s:.0f}s = {soak_rate:.2f} cases/s "
         f"(world sizes {dict(sorted(mix.items()))})")
    ratio = soak_rate / max(fuzz_rate, 1e-9)
    echo(f"soak vs one session, {target}, {workers} ranks, {seconds:.0f}s each: {ratio:.2f}x")
    return ratio


def run_session_bench(n: int, seed: int, target: str = "dtensor", worlds=(1, 2, 3, 4), echo=print,
                      device: str = "cpu") -> float:
    """One fuzz session, same seed and max examples, run one case at a time
    and then with packs side by side (no idle ranks), each on its own pool of
    max(worlds) ranks; a round that finds something ends at once (no
    shrinking), so both measure the search. Returns side-by-side cases/s
    over one-at-a-time cases/s."""
    import io
    import tempfile

    from .engine import Session
    from .options import SessionOptions

    rates = {}
    for mode, placed in (("one at a time", False), ("side by side", True)):
        with tempfile.TemporaryDirectory(prefix="fuzzshard-bench-") as tmp, \
                Pool(max(worlds), options=PoolOptions(device=device), placed=placed, spare=False) as pool:
            session = Session(pool, Draws((target,), tuple(worlds), device=device),
                              SessionOptions(out=tmp, max_examples=n, seed=seed, shrink_budget=0.0), progress=io.StringIO())
            session.run()
            st = session.stats
            rates[mode] = st.cases / session.elapsed
            echo(f"{mode}: {st.cases} cases ({st.valid} valid) in {session.elapsed:.1f}s = {rates[mode]:.2f} cases/s "
                 f"(packs of {session.pack}; {pool.restarts} restarts)")
    ratio = rates["side by side"] / max(rates["one at a time"], 1e-9)
    echo(f"session over world sizes {','.join(map(str, worlds))} on {max(worlds)} ranks, {target}, seed {seed}, "
         f"{n} examples: side by side {ratio:.2f}x one at a time")
    return ratio


# -- bench --simulate: simulated cases (kernel/simulated.py) against real ones -------------------------------
def run_simulate_bench(n: int, seed: int, target: str = "dtensor", echo=print, real_worlds=(2, 4, 8),
                       sim_worlds=(2, 4, 8, 16, 64), workers: int | None = None) -> dict:
    """Cases/s of the same cases simulated (one worker; and ``workers`` side
    by side, as a simulated session runs them) and real (a warm gloo pool of
    W processes, one case at a time), per world size. Each pool runs one
    untimed case of the size first (imports, torch's per-shape caches).
    Beside the wall clock, the CPU seconds its worker processes spent per
    case: on a machine others load, W real processes get W shares of the
    cores and one simulated worker one share, so the CPU ratio is what an
    idle machine's wall clock would give (side by side, one case per core)."""
    workers = workers or max(1, os.cpu_count() or 1)
    out: dict = {}
    echo(f"bench --simulate: {n} {target} cases per world size (seed {seed}); real: a warm pool of W gloo "
         f"processes; simulated: LocalTensorMode in one worker, and in {workers} side by side")
    for w in sorted(set(real_worlds) | set(sim_worlds)):
        *cases, spare = fixed_cases(n + 1, seed, Draws((target,), (w,)))
        row: dict = {}
        sides = ([("real", w, False, False)] if w in real_worlds else []) + \
                ([("sim1", 1, True, False)] + ([("simN", workers, True, True)]
                                               if workers > 1 else []) if w in sim_worlds else [])
        for name, size, simulate, side_by_side in sides:
            with Pool(size, options=PoolOptions(case_timeout=600, simulate=simulate), spare=False,
                      placed=side_by_side) as pool:
                pool.run_many([spare] * (pool.size if simulate else 1))  # every worker warm
                t0, cpu0 = time.perf_counter(), _cpu_seconds(pool)
                results = pool.run_many(cases) if side_by_side else [pool.run(c) for c in cases]
                seconds, cpu1 = time.perf_counter() - t0, _cpu_seconds(pool)
            # a worker replaced after a crash took what it spent with it: then the CPU is a lower bound
            cpu, lost = sum(t - cpu0.get(pid, 0.0) for pid, t in cpu1.items()), not cpu0.keys() <= cpu1.keys()
            statuses = dict(collections.Counter(r.verdict.status for r in results))
            row[name] = {"cases_per_s": len(cases) / seconds, "seconds": seconds, "statuses": statuses,
                         "cpu_per_case": cpu / len(cases), "cpu_lower_bound": lost}
            echo(f"  W={w:<3} {name:5} {len(cases) / seconds:7.2f} cases/s  ({seconds:.1f}s, CPU {'>=' if lost else ''}"
                 f"{cpu / len(cases):.2f}s a case; {', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))})")
        if "real" in row and "sim1" in row:
            best = max(row["sim1"]["cases_per_s"], row.get("simN", row["sim1"])["cases_per_s"])
            echo(f"  W={w:<3} simulated / real: {best / row['real']['cases_per_s']:.2f}x wall clock, "
                 f"{'>=' if row['real']['cpu_lower_bound'] else ''}"
                 f"{row['real']['cpu_per_case'] / row['sim1']['cpu_per_case']:.2f}x CPU a case")
        out[w] = row
    return out


def _cpu_seconds(pool) -> dict:
    """pid -> user + system CPU seconds each worker process of the pool has spent so far (Linux's /proc)."""
    out = {}
    for proc in pool.procs:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (name)"
        out[proc.pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in ticks
    return out


