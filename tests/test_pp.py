"""The ``pp`` target: pipeline parallelism (torch.distributed.pipelining's
PipelineStage and schedules), its draws, its refusals, and a planted 1F1B bug
found by a fuzz session, shrunk, and replayed."""
import dataclasses
import json

from hypothesis import HealthCheck, given, settings

import fuzzshard.strategies as fst
from conftest import PLANTED, replays_clean, run_cli, torchrun
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel.model import param_shapes
from fuzzshard.kernel.targets import pp
from fuzzshard.kernel.targets.pp import describe, draws, schedules


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=fst.cases(target="pp", world_sizes=[1, 2, 3, 4]))
def test_pp_draws_a_schedule_the_layers_can_fill(case):
    """A schedule torch has, one top-level layer or more per stage (pp degree x stages per rank), a 1-D mesh
    or a [pp, dp] one with FSDP2 (dp its second dim), n_microbatches up to one past each dp rank's slice of
    the batch; every drawn case passes the target's own check."""
    o = case.target_options
    assert case.mesh_shape == ((case.world_size,) if "dp" not in o else (case.world_size // o["dp"], o["dp"]))
    assert o["schedule"] in schedules.available()
    assert set(o) <= {"schedule", "stages", "cuts", "scale_grads", "n_microbatches", "dp", "reshard_after_forward",
                      "wrap", "accum"}, o
    assert len(o["cuts"]) == schedules.n_stages(o, case.world_size) - 1
    assert 1 <= o["n_microbatches"] <= case.batch // o.get("dp", 1) + 1
    assert draws.check(case) is None, draws.check(case)
    assert case.checkpoint is None or "n_microbatches" in case.checkpoint.target_options  # (test_pp_checkpoint.py)


def test_pp_stage_ranks_follow_torchs_mapping():
    """Loop style (stage s on rank s mod W) and V style (two stages a rank, r and 2W-1-r), as
    torch's generate_stage_to_rank_mapping says."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for world in (1, 2, 3, 4):
        for name, stages in (("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 3), ("ZBVZeroBubble", 2)):
            o = {"schedule": name, "stages": stages}
            style = schedules.SCHEDULES[name][1]
            want = generate_stage_to_rank_mapping(world, world * stages, style=style)
            assert schedules.stage_ranks(o, world) == [want[s] for s in range(world * stages)], (name, world)


def _case(schedule="1F1B", world=2, n_microbatches=2, batch=2, layers=2, stages=1, scale_grads=True) -> Case:
    model = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(layers)))
    o = {"schedule": schedule, "cuts": [round(i * layers / (world * stages)) for i in range(1, world * stages)],
         "scale_grads": scale_grads, "n_microbatches": n_microbatches}
    if stages > 1:
        o["stages"] = stages
    return Case(target="pp", world_size=world, mesh_shape=(world,), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),), batch=batch, seq=2, target_options=o)


def test_pp_check_refuses_what_cannot_be_cut():
    assert draws.check(_case()) is None
    assert "top-level layers" in draws.check(_case(world=3, layers=2))
    bad = _case()
    assert "cuts" in draws.check(dataclasses.replace(bad, target_options={**bad.target_options, "cuts": [0]}))
    # (a tied head is cut now, its grad all-reduced between the first and last stage's ranks: tests/test_tied.py)


def test_pp_a_documented_refusal_is_invalid_and_a_case_trains_in_parity(tmp_path):
    """1F1B with fewer microbatches than stages is refused by torch (ValueError, documented): an invalid case,
    never a finding. The same model with as many microbatches as stages trains in parity (scale_grads on:
    the schedule averages the microbatch grads, the reference the microbatch losses)."""
    refused = tmp_path / "refused.json"
    refused.write_text(_case(n_microbatches=1).to_json())
    r = run_cli("replay", refused)
    assert r.returncode == 2 and "invalid: documented" in r.stderr, r.stdout + r.stderr[-2000:]
    ok = tmp_path / "ok.json"  # (scale_grads off: the planted test's shrunk case passes on clean torch)
    ok_case = _case(n_microbatches=2, batch=4, scale_grads=True)
    # Adam's state, and a group per stage: each rank's optimizer holds one of them, the other left out
    ok_case = dataclasses.replace(ok_case, optim=Optim("Adam", {"lr": 0.01}), schedule=(Step(), Step(set_to_none=False)),
                                  groups=(Group(("layers.0.weight", "layers.0.bias")),
                                          Group(("layers.1.weight", "layers.1.bias"), {"lr": 0.1})))
    ok.write_text(ok_case.to_json())
    replays_clean(ok)


def test_planted_1f1b_bug_is_found_shrunk_and_replays(tmp_path):
    """Schedule1F1B loses the param grads of its second microbatch's backward: found by a short pp session
    as a grad parity finding, shrunk to one 1F1B stage, 2 microbatches, one step (the torch bugs this
    session also meets are known ones: counted, not shrunk); it replays as itself through fuzzshard and
    standalone under torchrun, and passes on unmodified torch."""
    bug = "pp_1f1b_drop_microbatch_grads.py"
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "pp", "--max-examples", 20, "--seed", 0, "--world-sizes", "2",
                "--optimizers", "SGD", "--checkpoints", "none", "--case-timeout", 60, "--shrink-budget", "30s",
                "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("pp.*.json"))
    assert [p.name for p in found] == ["pp.parity.grad.json"], f"{[p.name for p in found]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    sig, case = finding["signature"], finding["case"]
    assert finding["stage"] == "confirmed" and finding["deterministic"] is True
    o = case["target_options"]
    assert case["world_size"] <= 2 and o["schedule"] == "1F1B" and o["n_microbatches"] == 2, case
    assert len(case["schedule"]) == 1
    buggy = run_cli("replay", found[0], setup=bug)
    assert buggy.returncode == 1 and f"FAIL: {sig}" in buggy.stdout, buggy.stdout
    replays_clean(found[0])
    # the standalone script: straight-line (scriptgen/pp.py), not the flattened kernel
    script = found[0].with_suffix(".py")
    assert "CASE_JSON" not in script.read_text() and "Schedule1F1B(stages[0]" in script.read_text()
    buggy = torchrun(script, case["world_size"], "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode != 0 and "FINDING" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(script, case["world_size"], cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def hunt_shrink_replay(tmp_path, bug, seed, max_examples, shrink_budget="30s", world_sizes="2") -> dict:
    """A short pp session with ``bug`` planted: its one new finding (a grad parity finding), confirmed and
    deterministic, replaying as itself with the bug and passing on unmodified torch; returns the finding."""
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "pp", "--max-examples", max_examples, "--seed", seed, "--world-sizes", world_sizes,
                "--optimizers", "SGD", "--checkpoints", "none", "--case-timeout", 60, "--shrink-budget", shrink_budget,
                "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("pp.*.json"))
    assert [p.name for p in found] == ["pp.parity.grad.json"], f"{[p.name for p in found]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    assert finding["stage"] == "confirmed" and finding["deterministic"] is True
    buggy = run_cli("replay", found[0], setup=bug)
    assert buggy.returncode == 1 and f"FAIL: {finding['signature']}" in buggy.stdout, buggy.stdout
    replays_clean(found[0])
    return finding


def test_planted_zero_bubble_dw_twice_is_found_shrunk_and_replays(tmp_path):
    """The zero-bubble split backward counts the first microbatch's weight grads (backward_weight_one_chunk)
    twice: found as a grad parity finding (new: pp.parity.grad, not the known vanished grads), shrunk to a
    split-backward schedule on one rank, its two virtual stages (the fewest), one microbatch, one step."""
    case = hunt_shrink_replay(tmp_path, "pp_zero_bubble_dw_twice.py", 6, 25)["case"]
    o = case["target_options"]
    assert o["schedule"] in schedules.SPLIT_BACKWARD and schedules.n_stages(o, case["world_size"]) == 2, case
    assert o["n_microbatches"] == 1 and len(case["schedule"]) == 1, case


def test_planted_looped_stage_scale_is_found_shrunk_and_replays(tmp_path):
    """Interleaved1F1B / LoopedBFS divide a rank's later virtual stage's summed grads by n_microbatches x its
    stages: found as a grad parity finding, shrunk to a looped schedule on one rank, two virtual stages,
    two microbatches (one would not be scaled), scale_grads on, one step."""
    case = hunt_shrink_replay(tmp_path, "pp_looped_stage_scale.py", 0, 20, "20s")["case"]
    o = case["target_options"]
    assert o["schedule"] in ("Interleaved1F1B", "LoopedBFS") and schedules.n_stages(o, case["world_size"]) == 2, case
    assert o["n_microbatches"] == 2 and o["scale_grads"] is True and len(case["schedule"]) == 1, case


def test_pp_lr_scheduler_steps_each_ranks_groups_in_the_case_order(tmp_path):
    """An LR scheduler over each rank's optimizer (Spec.lr_scheduler): three groups, the first and last on
    stage 1's rank, the middle one on stage 0's, with their own lrs; the scheduler's last lrs observed per
    case group in the case's order match the reference's one scheduler over all three, every step."""
    from fuzzshard.case import LRScheduler

    case = _case(n_microbatches=2, batch=2, scale_grads=False)
    case = dataclasses.replace(case, schedule=(Step(), Step(), Step()),
                               groups=(Group(("layers.1.weight",), {"lr": 0.3}),
                                       Group(("layers.0.weight", "layers.0.bias"), {"lr": 0.2}),
                                       Group(("layers.1.bias",))),
                               lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}))
    path = tmp_path / "lr.json"
    path.write_text(case.to_json())
    replays_clean(path)
    assert pp.PPTarget.spec.lr_scheduler and not pp.PPTarget.spec.clips


def test_pp_facts_see_a_stage_input_without_grad_from_a_steps_freeze():
    """facts' split_backward_input_without_grad (what the known pp.parity.grad.vanished is known under) follows
    the schedule's freezes and unfreezes: a first stage frozen by step 0's flags, not by the case's frozen
    params, counts (a clean 2.15.0 session met it reported new), and an unfreeze before every step does not."""
    case = dataclasses.replace(_case(schedule="InterleavedZeroBubble", world=1, n_microbatches=1, batch=1, stages=2),
                               frozen=("layers.0.weight",))
    assert not describe.facts(case)["split_backward_input_without_grad"]
    freeze = dataclasses.replace(case, schedule=(Step(freeze=("layers.0.bias",)),))
    assert describe.facts(freeze)["split_backward_input_without_grad"]
    thawed = dataclasses.replace(case, frozen=("layers.0.weight", "layers.0.bias"),
                                 schedule=(Step(unfreeze=("layers.0.bias",)),))
    assert not describe.facts(thawed)["split_backward_input_without_grad"]
    assert describe.facts(dataclasses.replace(freeze, target_options={**freeze.target_options, "schedule": "Interleaved1F1B"})
                    )["split_backward_input_without_grad"] is False


def test_planted_zero_bubble_dw_twice_is_caught_on_its_shrunk_case(tmp_path):
    """The zero-bubble bug on the case its session shrinks to (InterleavedZeroBubble on one rank, two virtual
    stages, one microbatch: test_pp_script.SHRUNK): passes on unmodified torch, a grad parity finding with the
    bug. The session (slow tier) proves it is found and shrunk there; the 1F1B session above keeps pp's search
    and shrinking in the default tier."""
    from conftest import replay_clean_then_buggy
    from test_pp_script import SHRUNK

    bug, case, _ = SHRUNK[1]
    assert bug == "pp_zero_bubble_dw_twice.py"
    buggy = replay_clean_then_buggy(tmp_path, case, bug)
    assert "FAIL: pp.parity.grad" in buggy, buggy
