"""Per-case speed of two trees on the same cases (a change's cost on the cases that use none of what it adds:
a new draw re-rolls a seed's cases, so `bench` on one seed compares different cases).

    python ci/same_cases.py draw CASES.jsonl [TARGET [SEED [N [WORLD]]]]   # bench's draw: N+1 cases, no checkpoint
    python ci/same_cases.py time CASES.jsonl                               # each case on one warm pool

Draw with the older tree (PYTHONPATH=that tree; a tree whose strategies/ sits at the top needs
`ln -s ../strategies fuzzshard/strategies` there, docs/search.md), then time the file on each tree in turn,
a few times, taking turns (the machine's load moves the numbers). `time` runs the first line as a spare (the
process's first-call costs), then each case once as a session runs it (torch's per-shape caches cold: "first
run") and 3 times more (the median: "warm"); it prints the cases/s of each and the first run's split.
"""
import json
import statistics
import sys
import time

if "-h" in sys.argv or "--help" in sys.argv or len(sys.argv) < 3 or sys.argv[1] not in ("draw", "time"):
    print(__doc__.strip())
    sys.exit(0 if "-h" in sys.argv or "--help" in sys.argv else 2)

from fuzzshard.case import Case  # noqa: E402

if sys.argv[1] == "draw":
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst

    args = sys.argv[3:] + ["dtensor", "0", "30", "2"][len(sys.argv[3:]):]
    target, seed, n, world = args[0], int(args[1]), int(args[2]), int(args[3])
    out = []

    @hseed(seed)
    @settings(max_examples=n + 1, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target=target, world_sizes=[world], checkpoint=False))
    def collect(case):
        if len(out) < n + 1:
            out.append(case)

    collect()
    with open(sys.argv[2], "w") as f:
        f.writelines(c.to_json() + "\n" for c in out)
    print(f"{len(out)} {target} cases (seed {seed}, W={world}; the first a spare) in {sys.argv[2]}")
    sys.exit(0)

from fuzzshard.pool.options import PoolOptions  # noqa: E402
from fuzzshard.pool.runner import Pool  # noqa: E402

spare, *cases = [Case.from_json(line) for line in open(sys.argv[2]) if line.strip()]
pool = Pool(max(c.world_size for c in [spare, *cases]), options=PoolOptions()).start()
rows = []
try:
    pool.run(spare)
    for c in cases:
        t = time.perf_counter()
        r = pool.run(c)
        first = time.perf_counter() - t
        hot = []
        for _ in range(3):
            t = time.perf_counter()
            pool.run(c)
            hot.append(time.perf_counter() - t)
        rows.append({"first": first, "warm": statistics.median(hot), "status": str(r.verdict.status),
                     "timings": dict(r.timings)})
    restarts = pool.restarts
finally:
    pool.close()
k = len(rows)
split = {key: round(1000 * sum(r["timings"].get(key, 0.0) for r in rows) / k, 1)
         for key in sorted({key for r in rows for key in r["timings"]})}
print(json.dumps({"cases": k, "first_run_per_s": round(k / sum(r["first"] for r in rows), 2),
                  "warm_per_s": round(k / sum(r["warm"] for r in rows), 2), "restarts": restarts,
                  "passed": sum(r["status"].lower().endswith("pass") for r in rows), "first_run_ms": split}))
