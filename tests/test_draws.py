"""The built-in targets' draws stay what they were (see tests/draws.py), and every case
drawn with the loop on is one the validity rule (Case.check) takes, by construction.

In a fresh interpreter: Hypothesis mixes literals of the imported modules into
what it generates, so a draw depends on what else the process has imported."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_the_strategies_draw_what_they_drew():
    pinned = json.loads((HERE / "data" / "draw_digests.json").read_text())
    r = subprocess.run([sys.executable, str(HERE / "draws.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    now = json.loads(r.stdout)
    if now["hypothesis"] != pinned["hypothesis"]:
        pytest.skip(f"digests pinned with Hypothesis {pinned['hypothesis']}, running {now['hypothesis']}: "
                    "regenerate with `python tests/draws.py --write`")
    assert now == pinned


def test_compile_is_drawn_only_when_asked_and_then_in_every_fsdp2_case():
    """--compile: every fsdp2 case compiles its blocks, before or after
    fully_shard, half of them the step too; without it nothing compiles."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst

    seen = {True: [], False: []}
    for asked in (True, False):
        @hseed(0)
        @settings(max_examples=30, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target="fsdp2", world_sizes=[1, 2], models=("decoder",), compile=asked))
        def collect(case):
            seen[asked].append(case.target_options)

        collect()
    assert {o.get("compile") for o in seen[True]} == {"before", "after"}
    assert {bool(o.get("compile_step")) for o in seen[True]} == {True, False}
    assert not any(o.get("compile") or o.get("compile_step") for o in seen[False])


def _draw_with_the_loop_on(target: str, n: int, **kwargs) -> tuple[list, list]:
    """``n`` seeded draws of ``target`` with every loop feature asked for: (the cases, the cases the
    strategy's closing ``assume`` of the validity rule refused: what the draw did not take by construction)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst
    from fuzzshard.strategies.loop import FEATURES

    drawn, refused, rule = [], [], fst.valid

    def watched(case):
        ok = rule(case)
        if not ok:
            refused.append(case)
        return ok

    fst.valid = watched  # cases() asks it last: a case it refuses was drawn, then thrown away
    try:
        @hseed(0)
        @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target=target, loop=FEATURES, **kwargs))
        def collect(case):
            drawn.append(case)

        collect()
    finally:
        fst.valid = rule
    return drawn, refused


@pytest.mark.parametrize("target", __import__("fuzzshard.targets", fromlist=["builtin"]).builtin())
def test_every_target_draws_only_cases_the_validity_rule_takes_with_the_loop_on(target):
    """Every case drawn with the whole loop on (strategies/loop.py's FEATURES) passes Case.check, the rule
    replay, show, the reducer and the workers ask; and the draw takes it by construction (the strategy's
    closing assume of it never had to throw one away). A session once drew, ran and reported 16 ZeRO cases
    with uneven inputs under Join and an LR scheduler, which `show` refuses."""
    drawn, refused = _draw_with_the_loop_on(target, 100, world_sizes=[1, 2, 3, 4])
    assert len(drawn) >= 90
    assert [c.refusal() for c in drawn if c.refusal()] == []
    assert [c.refusal() for c in refused] == []
    # the loop is drawn (each feature the target takes, in some cases and not others)
    assert any(c.clip or c.lr_scheduler or c.scaler for c in drawn) and not all(c.clip for c in drawn)


def test_zero_uneven_inputs_under_join_are_drawn_without_the_loop_and_the_loop_without_them():
    """Where uneven inputs are likely (ZeRO over DDP, no checkpoint, one group): uneven cases are drawn, none
    with a clip, an LR scheduler or a scaler (ZeroJoinHook steps a joined rank without them), and the loop
    is drawn in the other cases as before."""
    # 300 draws: uneven inputs are drawn in a quarter of the joinable cases, and joinable ones are few (one in
    # 13 here; an MoE case is never joinable); 100 seeded draws met none once the MoE draw moved the draws
    drawn, refused = _draw_with_the_loop_on("zero", 300, world_sizes=[2, 3], checkpoint=False, max_groups=1)
    uneven = [c for c in drawn if "uneven" in c.target_options]
    assert uneven and refused == [], [c.refusal() for c in refused]
    assert not any(c.clip or c.lr_scheduler or c.scaler for c in uneven)
    assert any(c.clip or c.lr_scheduler or c.scaler for c in drawn)


def test_the_loop_draw_asks_the_validity_rule_which_features_a_case_takes():
    """strategies' _loop_taken: every feature for a case the rule takes with each of them; none of clip,
    scheduler and scaler for a ZeRO case with uneven inputs (Case.check refuses them there)."""
    import dataclasses

    from cases import simple_case
    from fuzzshard.case import LRScheduler
    from fuzzshard.strategies import _loop_taken
    from fuzzshard.strategies.loop import FEATURES

    zero = dataclasses.replace(simple_case(2), target="zero", target_options={"ddp": {}})
    assert _loop_taken(zero, FEATURES) == FEATURES
    uneven = dataclasses.replace(zero, target_options={"ddp": {}, "uneven": [1, 2]})
    assert uneven.refusal() is None and _loop_taken(uneven, FEATURES) == ("async_save",)
    refused = dataclasses.replace(uneven, lr_scheduler=LRScheduler("StepLR", {"step_size": 1}))
    assert "uneven inputs under Join" in refused.refusal()
