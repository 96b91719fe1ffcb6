"""``fuzzshard bench``: the warm pool against a fresh process group per case
(what PyTorch's MultiProcessTestCase does), on the same cases, in one run;
and what a checkpoint round trip adds to a case (the same cases again, each
saved after its first step and resumed, per kind). The last line ends with
the speed-up ratio."""
from __future__ import annotations

import collections
import dataclasses
import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from .runner import Pool


def fixed_cases(n: int, world: int, seed: int, target: str = "dtensor", device: str = "cpu") -> list:
    """The same n cases for a given seed, drawn by the fuzzer's own strategy."""
    import fuzzshard.strategies as fst

    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target=target, world_sizes=[world], checkpoint=False, device=device))
    def collect(case):
        if len(out) < n:
            out.append(case)

    collect()
    return out


def run_bench(n: int, world: int, seed: int, target: str = "dtensor", echo=print, device: str = "cpu") -> dict:
    cases = fixed_cases(n, world, seed, target, device)
    echo(f"bench: {len(cases)} {target} cases at world size {world} on {device} (seed {seed}), each run both ways")

    t0 = time.perf_counter()
    pool = Pool(world, device=device).start()
    start_s = time.perf_counter() - t0
    split = collections.Counter()
    statuses = collections.Counter()
    t0 = time.perf_counter()
    try:
        for case in cases:
            r = pool.run(case)
            statuses[r.verdict["status"]] += 1
            split["total"] += r.seconds
            for k, v in r.timings.items():
                split[k] += v
        warm_s = time.perf_counter() - t0
        restarts, restart_s = pool.restarts, pool.restart_seconds
        from . import targets

        ckpt_ms = _checkpoint_cost(pool, cases) if targets.get(target).spec.checkpoint_kinds else {}
    finally:
        pool.close()

    t0 = time.perf_counter()
    for case in cases:  # a fresh process group per case: spawn, import torch, init, run, tear down
        fresh = Pool(world, device=device, spare=False, zygote=False).start()
        try:
            fresh.run(case)
        finally:
            fresh.close()
    fresh_s = time.perf_counter() - t0

    k = len(cases)
    per = {key: 1000 * v / k for key, v in split.items()}
    overhead = per["total"] - per.get("sharded", 0) - per.get("reference", 0)
    echo(f"verdicts: {dict(statuses)}")
    echo(f"warm pool start (once per session): {start_s:.2f}s")
    echo(f"warm per case: {per['total']:.0f} ms = sharded run, meshes included {per.get('sharded', 0):.0f}"
         f" + reference & compare {per.get('reference', 0):.0f} + dispatch {overhead:.0f}")
    echo(f"pool restarts after hangs/crashes/stuck ranks: {restarts}, {restart_s:.1f}s in all")
    for kind, (ms, n) in ckpt_ms.items():
        echo(f"checkpoint round trip ({kind}): +{ms:.0f} ms per case (save after step 0, fresh model + optimizer, "
             f"load, same world; mean over {n} passing cases)")
    echo(f"fresh per case: {1000 * fresh_s / k:.0f} ms (process spawn + torch import + init_process_group each time)")
    warm_rate, fresh_rate = k / warm_s, k / fresh_s
    ratio = warm_rate / fresh_rate
    echo(f"warm pool {warm_rate:.2f} cases/s vs fresh process group {fresh_rate:.2f} cases/s: {ratio:.1f}x")
    return {"warm_rate": warm_rate, "fresh_rate": fresh_rate, "ratio": ratio, "start_s": start_s, "per_case_ms": per,
            "checkpoint_ms": {kind: ms for kind, (ms, _) in ckpt_ms.items()}}


def _checkpoint_cost(pool, cases) -> dict:
    """kind -> (mean extra ms, cases): each case run again without and then
    with a round trip after its first step, back to back (the first pass's
    times carry cold-start costs, so they are no fair baseline)."""
    from . import targets
    from .case import Checkpoint

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
            elif plain.verdict["status"] == with_ck.verdict["status"] == "pass":
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
    from pathlib import Path

    from .report import load_cases

    base = [sys.executable, "-m", "fuzzshard"]
    worlds = ",".join(str(w) for w in range(1, workers + 1))
    with tempfile.TemporaryDirectory(prefix="fuzzshard-bench-") as tmp:
        t0 = time.perf_counter()
        r = subprocess.run(base + ["fuzz", "--target", target, "--duration", f"{seconds}s", "--world-sizes", worlds,
                                   "--seed", str(seed), "--out", f"{tmp}/fuzz"], capture_output=True, text=True)
        fuzz_s = time.perf_counter() - t0
        fuzz_cases = int(next(line for line in r.stderr.splitlines() if " cases · " in line and "valid" in line).split()[0])
        t0 = time.perf_counter()
        subprocess.run(base + ["soak", "--targets", target, "--duration", f"{seconds}s", "--epoch", f"{seconds / 3:.0f}s",
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
