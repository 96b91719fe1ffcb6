"""Count what --ao draws on fsdp2 as a timed session's first round draws it (the empty schedule's steer), for the
planted corners of the ao_ hunt (tests/planted/hunt.json): float8 drawn, its all-gather at W>1 and with 2+ steps,
low-bit optimizers at W>1, with a checkpoint, through DCP, resharded. Independent of the machine's load.

    python ci/ao_draw_counts.py [N [TARGET [ckall]]]   # N cases (10 per seed), ckall: as --checkpoints all
"""
import sys, collections

if "-h" in sys.argv or "--help" in sys.argv:
    print(__doc__.strip())
    sys.exit(0)

from hypothesis import HealthCheck, Phase, given, settings, seed as hseed
import fuzzshard.strategies as fst
from fuzzshard.session.schedule import Scheduler
from fuzzshard.session.options import Draws

N = int(sys.argv[1]) if len(sys.argv) > 1 else 150
target = sys.argv[2] if len(sys.argv) > 2 else "fsdp2"
ws = [1, 2, 4]
draws = Draws(ao=True, checkpoint=True) if "ckall" in sys.argv else Draws(ao=True)
sch = Scheduler()
pin = sch.steer(target, ws, draws.strategy_kwargs())
c = collections.Counter()
tried = [0]
rule = fst.valid
def watched(case):
    tried[0] += 1
    return rule(case)
fst.valid = watched
PER = 10
for s in range(N // PER):
    @hseed(s)
    @settings(max_examples=PER, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target=target, world_sizes=ws, **{**draws.strategy_kwargs(), **pin}))
    def collect(case):
        o = case.target_options
        f8 = o.get("float8")
        c["valid"] += 1
        steps = len(case.schedule) if hasattr(case.schedule, "__len__") else 0
        if f8:
            c["float8"] += 1
            c[f"f8 recipe {f8['recipe']}"] += 1
            if f8.get("all_gather"): c["f8 all-gather any W"] += 1
            if f8.get("all_gather") and case.world_size > 1:
                c["f8 all-gather W>1"] += 1
                if steps >= 2:
                    c["f8 all-gather W>1 steps>=2"] += 1
                    if f8.get("precompute"): c["  ... with precompute"] += 1
        if case.optim.name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
            c["lowbit"] += 1
            if case.world_size > 1:
                c["lowbit W>1"] += 1
                if steps >= 2: c["lowbit W>1 steps>=2"] += 1
            if case.checkpoint:
                c["lowbit ck"] += 1
                c[f"lowbit ck {case.checkpoint.kind}"] += 1
                if case.checkpoint.kind == "dcp" and case.checkpoint.world_size != case.world_size:
                    c["lowbit dcp reshard"] += 1
        if steps >= 2: c["steps>=2"] += 1
        if case.world_size > 1: c["W>1"] += 1
    collect()
print("drawn(valid):", c["valid"], "attempts reaching valid():", tried[0])
for k, v in sorted(c.items()):
    print(f"  {k}: {v}")
