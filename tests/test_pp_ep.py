"""The ``pp`` target with expert parallelism over the dp dim of a [pp, dp] mesh (``ep``): each stage's MoE experts
Shard(0) over dp with ep's ``ExpertParallel`` (all-to-all dispatch and combine over dp), left out of the stage's
FSDP2, their grads divided by dp; the rules and the draw (off first, only where the experts divide over dp), and a
planted pipelining bug that only the experts outside FSDP2 meet, caught on a hand-written case."""
import dataclasses
import re

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel.model import param_shapes
from fuzzshard.kernel.targets.pp import describe, draws


def _case(schedule="GPipe", n_microbatches=2, experts=4, ep=True, steps=1) -> Case:
    """Two MoE layers (4 experts of hidden 2 over 3 features) between Linears, cut into 2 stages of 2 layers, on a
    [2, 2] mesh: FSDP2 over dp 2 on each stage, ``ep`` over the same dp dim."""
    moe = {"experts": experts, "hidden": 2}
    model = Model("features", 3, (Layer("linear", 3, 3), Layer("moe", 3, 3, moe=moe), Layer("linear", 3, 3),
                                  Layer("moe", 3, 3, moe=moe)))
    o = {"schedule": schedule, "cuts": [2], "scale_grads": True, "n_microbatches": n_microbatches, "dp": 2,
         "reshard_after_forward": False, **({"ep": True} if ep else {})}
    return Case(target="pp", world_size=4, mesh_shape=(2, 2), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),) * steps, batch=8, seq=2,
                target_options=o, seed=1)


def test_pp_ep_rules_fit_and_facts():
    """ep needs the 2-D mesh's dp and experts dividing over it, and is refused with AC or a checkpoint; it is
    dropped on a 1-D mesh; the facts, the coverage and show name it; the script falls back saying why."""
    case = _case()
    case.check()
    assert draws.check(case) is None
    assert "do not divide" in draws.check(_case(experts=3))
    one_d = dataclasses.replace(case, world_size=2, mesh_shape=(2,), target_options={
        k: v for k, v in case.target_options.items() if k not in ("dp", "reshard_after_forward")})
    assert "2-D mesh" in draws.check(one_d)
    plain = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(4)))
    assert "no MoE" in draws.check(dataclasses.replace(case, model=plain, groups=(Group(tuple(param_shapes(plain))),)))
    assert "activation checkpointing" in draws.check(dataclasses.replace(
        case, target_options={**case.target_options, "ac": ["layers.1"]}))
    assert "ep" not in draws.fit_options(dict(case.target_options), [2], 1)
    assert describe.facts(case)["ep"] and not describe.facts(_case(ep=False))["ep"]
    assert describe.coverage(case)["schedule x world"] == ["GPipe W4 FSDP2 [2,2] + EP over dp"]
    from fuzzshard.scriptgen import fallback_reason

    # the pp script writes no MoE layer yet (with or without ep): the flattened kernel is the repro, saying why
    assert fallback_reason(case) == "an MoE layer under pp (its writer does not write one)"
    from fuzzshard.findings.record import Finding
    from fuzzshard.report.show import render

    assert "(ep: each stage's MoE experts Shard(0) over the dp dim (2 ranks)" in render(
        Finding(signature="", case=case, verdict=None))


def test_pp_ep_is_drawn_off_first_and_only_where_the_experts_divide():
    """Seeded pp draws at world size 4 steered to [2, 2]: ep among them (off in some MoE cases: it shrinks there),
    always with experts dividing over dp; every case drawn is valid."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst
    from fuzzshard.kernel.moe import moe_configs_of

    seen = []

    @hseed(3)
    @settings(max_examples=60, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="pp", world_sizes=[4], checkpoint=False, steer={"mesh": {4: [(2, 2)]}}))
    def collect(case):
        seen.append(case)

    collect()
    ep = [c for c in seen if c.target_options.get("ep")]
    assert ep, [c.target_options for c in seen]
    assert any(moe_configs_of(c.model) and not c.target_options.get("ep") for c in seen)
    for c in ep:
        assert len(c.mesh_shape) == 2 and all(m.get("experts", 2) % c.mesh_shape[1] == 0 for m in moe_configs_of(c.model))
        assert draws.check(c) is None


def test_planted_scale_grads_skipping_experts_is_caught_under_pp_ep(tmp_path):
    """pipelining's scale_grads dividing only FSDP2's params (EP's experts, outside FSDP2, keep n_microbatches times
    their grad): the hand-written case passes on clean torch and fails with the plant as a grad parity finding in the
    experts' params only (w1, w2, w3 of both MoE layers, one on each stage)."""
    from conftest import replay_clean_then_buggy

    buggy = replay_clean_then_buggy(tmp_path, _case(), "pp_ep_scale_grads_skips_experts.py")
    assert "FAIL: pp.parity.grad" in buggy, buggy
    named = set(re.findall(r"grad (layers\.\d+\.[\w.]+)", buggy))
    assert named and all(".experts.w" in n for n in named), (named, buggy)
    assert {n.split(".")[1] for n in named} == {"1", "3"}, named  # both stages' experts



def test_a_timed_session_steers_toward_pp_ep_and_ep_tp_where_the_mesh_allows():
    """The schedule's option corner (Spec.corner; session/schedule.py): a timed session's 2-D cases are aimed at pp's
    ``ep`` (an MoE whose experts divide over dp, no checkpoint) and at ep's ``tp`` (no checkpoint) half the time,
    until the corner is covered as often as its absence. Seeded draws at world size 4, as the hunt's: pp reaches ep
    many times more often than unsteered (1 case in ~300 of a session's before: ci/moe_corner_counts.py), ep its tp
    more often; the aim is off first (an aimed case shrinks to today's draw), and once the corner has had its cases
    the aim turns mostly off."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst
    from fuzzshard.session.schedule import Scheduler, corner_cell

    for target, option, times in (("pp", "ep", 4), ("ep", "tp", 1.5)):
        pin = Scheduler().steer(target, [4], {})
        assert pin["steer"]["corner"] == [False, True]  # off first
        reached = {}
        for steered in (False, True):
            seen = []

            @hseed(0)
            @settings(max_examples=80, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(fst.cases(target=target, world_sizes=[4], **(pin if steered else {})))
            def collect(case):
                seen.append(case)

            collect()
            reached[steered] = [c for c in seen if corner_cell(c) == option]
        assert len(reached[True]) >= 10 and len(reached[True]) >= times * len(reached[False]), \
            (target, len(reached[True]), len(reached[False]))
        for c in reached[True]:
            assert c.refusal() is None and len(c.mesh_shape) == 2
            assert target != "pp" or draws.ep_fits(c.model, c.mesh_shape[1])
        assert any(c.checkpoint is None for c in reached[True])
        sched = Scheduler()
        for c in reached[True][:6]:
            sched.record(c, valid=True)
        assert sched.steer(target, [4], {})["steer"]["corner"] == [False] * 4 + [True], target  # covered: mostly off
