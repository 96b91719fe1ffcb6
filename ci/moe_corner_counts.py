"""Count how often a timed session's draws reach issue 46's two slow MoE corners, independent of the machine's load:
pp's ``ep`` (W=4, a [pp, dp] mesh, an MoE whose experts divide over dp, ``ep`` and ``scale_grads`` drawn, 2+
microbatches, no checkpoint: the pp_ep_scale_grads_skips_experts plant) and ep's ``tp`` (W=4, [dp, tp]: the
ep_tp_router_grad_unreduced_over_tp plant). The draws are a session's: rounds of 25 cases (seeds 0, 1, ...), each
steered (session/schedule.py Scheduler.steer) by the cells of the cases drawn before it, as a --duration session's
rounds are (a case's verdict aside: each counts once, as a valid case).

    python ci/moe_corner_counts.py [N [TARGET]]   # N cases (default 300) of TARGET (pp or ep; default both)
"""
import collections
import sys

if "-h" in sys.argv or "--help" in sys.argv:
    print(__doc__.strip())
    sys.exit(0)

from hypothesis import HealthCheck, Phase, given, settings, seed as hseed

import fuzzshard.strategies as fst
from fuzzshard.kernel.moe import moe_configs_of
from fuzzshard.session.options import Draws
from fuzzshard.session.schedule import Scheduler

N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
targets = [sys.argv[2]] if len(sys.argv) > 2 else ["pp", "ep"]
WORLDS = [4]  # the hunt's --world-sizes 4
PER = 25  # a timed session's round


def cells(case) -> list[str]:
    o = case.target_options
    out = [f"mesh {'x'.join(map(str, case.mesh_shape))}"]
    if case.checkpoint:
        out.append("checkpoint")
    if moe_configs_of(case.model):
        out.append("MoE")
    if case.target == "pp" and len(case.mesh_shape) == 2 and not case.checkpoint and moe_configs_of(case.model):
        out.append("[pp, dp] + MoE, no checkpoint")
        if o.get("ep"):
            out.append("  ... ep")
            if o.get("scale_grads"):
                out.append("  ... ep, scale_grads")
                if o.get("n_microbatches", 1) >= 2:
                    out.append("  ... ep, scale_grads, 2+ microbatches (THE CORNER)")
    if case.target == "ep" and o.get("tp"):
        out.append("tp (THE CORNER)")
    return out


for target in targets:
    sch, c = Scheduler(), collections.Counter()
    for rnd in range(-(-N // PER)):
        pin = sch.steer(target, WORLDS, Draws().strategy_kwargs())
        drawn = []

        @hseed(rnd)
        @settings(max_examples=PER, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target=target, world_sizes=WORLDS, **{**Draws().strategy_kwargs(), **pin}))
        def collect(case):
            drawn.append(case)

        collect()
        for case in drawn:
            sch.record(case, valid=True)
            c["cases"] += 1
            c.update(cells(case))
    print(f"{target}: {c['cases']} cases (W=4, rounds of {PER}, steered)")
    for k, v in sorted(c.items()):
        if k != "cases":
            print(f"  {k}: {v}")
