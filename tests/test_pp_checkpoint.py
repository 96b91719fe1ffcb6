"""The ``pp`` target's checkpoints (issue 39): each rank saves its own model part and flattened optimizer state
dict by plain FQN through DCP, as torchtitan saves a pipeline, and the loading side builds the pipeline again at
another pp degree (its own world size, schedule, stages per rank, cuts and microbatch count), loads, and the
continued steps must match the run that never stopped. A clean seeded session reshards across pp degrees with no
new finding; a planted DSD bug (a param's optimizer state loaded under another param's FQN) is found by the
loaded oracle, shrunk, and replays as itself."""
import dataclasses
import json
import math
import re

from hypothesis import HealthCheck, given, settings

import fuzzshard.strategies as fst
from conftest import replays_clean, run_cli
from fuzzshard.case import Case, Checkpoint, Group, Layer, LRScheduler, Model, Optim, Step
from fuzzshard.kernel.model import param_shapes
from fuzzshard.kernel.targets.pp import describe, draws, schedules


@settings(max_examples=30, database=None, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=fst.cases(target="pp", world_sizes=[1, 2, 3, 4], checkpoint=True))
def test_pp_checkpoint_draws_a_loading_side_that_is_a_pp_case_of_its_own(case):
    """Every drawn pp case has a dcp checkpoint whose loading side is a pp case at its own world size and mesh
    (its own schedule, cuts, late-drawn microbatch count; FSDP2 on a [pp, dp] mesh), no side with a rank that
    holds no state; the check refuses
    another kind and an LR scheduler beside a checkpoint."""
    ck = case.checkpoint
    assert ck is not None and ck.kind == "dcp"
    o = ck.target_options
    assert math.prod(ck.mesh_shape) == ck.world_size and o.get("dp") == (ck.mesh_shape[1:] or (None,))[0]
    assert len(o["cuts"]) == schedules.n_stages(o, ck.world_size) - 1 and 1 <= o["n_microbatches"] <= case.batch + 1
    assert draws.check(case) is None, draws.check(case)
    loading = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=ck.mesh_shape, target_options=o,
                                  checkpoint=None)
    assert not draws.stateless_ranks(case) and not draws.stateless_ranks(loading)
    assert "kind" in draws.check(dataclasses.replace(case, checkpoint=dataclasses.replace(ck, kind="full")))
    assert "LR scheduler" in draws.check(dataclasses.replace(case, lr_scheduler=LRScheduler("StepLR", {"step_size": 1})))


def test_pp_facts_count_the_loading_sides_schedule_after_the_load():
    """Saved under GPipe, loaded under ZBVZeroBubble (a split backward) with the first stage's params frozen by
    step 1's flags: the steps after the load meet the known zero-bubble bug of a stage input without grad
    (facts' split_backward_input_without_grad, what the known pp.parity.grad.vanished is known under), which
    the saving side's schedule alone would not say; a load after the last step changes nothing."""
    model = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(2)))
    names = tuple(param_shapes(model))
    loading = {"schedule": "ZBVZeroBubble", "stages": 2, "cuts": [1], "scale_grads": False, "n_microbatches": 2}
    case = Case(target="pp", world_size=2, mesh_shape=(2,), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(names),), schedule=(Step(), Step(freeze=("layers.0.weight", "layers.0.bias"))),
                batch=2, seq=2, target_options={"schedule": "GPipe", "cuts": [1], "scale_grads": False,
                                                "n_microbatches": 2},
                checkpoint=Checkpoint(after=0, kind="dcp", world_size=1, mesh_shape=(1,), target_options=loading))
    assert draws.check(case) is None, draws.check(case)
    assert not describe.facts(case)["split_backward_input_without_grad"]
    assert describe.facts_with_checkpoint(case)["split_backward_input_without_grad"]
    last = dataclasses.replace(case, checkpoint=dataclasses.replace(case.checkpoint, after=1))
    assert not describe.facts_with_checkpoint(last)["split_backward_input_without_grad"]


def test_pp_checkpoint_clean_session_reshards_across_pp_degrees(tmp_path):
    """A short seeded pp session with a checkpoint in every case, at world sizes 1 and 2: no new finding (the
    known DSD bugs it meets are counted as known hits), and passing cases that loaded at another pp degree
    (the number of stages saved -> loaded differs)."""
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "pp", "--max-examples", 12, "--seed", 3, "--world-sizes", "1,2",
                "--checkpoints", "all", "--case-timeout", 60, "--shrink-budget", "20s", "--out", out)
    assert r.returncode == 0 and "no new findings" in r.stdout + r.stderr, r.stdout + r.stderr[-3000:]
    assert not list(out.glob("pp.*.json"))
    line = re.search(r"passing checkpoint stages saved -> loaded: (.*)", r.stdout + r.stderr)
    assert line, r.stdout + r.stderr[-3000:]
    resharded = [(a, b) for a, b in re.findall(r"(\d+) -> (\d+) \d+", line.group(1)) if a != b]
    assert resharded, line.group(0)


def test_planted_pp_checkpoint_state_under_wrong_fqn_is_found_shrunk_and_replays(tmp_path):
    """DSD's unflatten of the flattened optimizer state dict gives two same-shaped params of a group each
    other's state (tests/planted/pp_ckpt_state_wrong_fqn.py): found by the loaded oracle (loaded state vs
    saved, exactly), shrunk to one group of two params, replaying as itself with the bug and passing without."""
    bug = "pp_ckpt_state_wrong_fqn.py"
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "pp", "--max-examples", 10, "--seed", 1, "--world-sizes", "1,2",
                "--optimizers", "Adam", "--checkpoints", "all", "--case-timeout", 60, "--shrink-budget", "15s",
                "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("pp.*.json"))
    assert [p.name for p in found] == ["pp.checkpoint.dcp.loaded.state.exp_avg.json"], \
        f"{[p.name for p in found]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    case = finding["case"]
    assert finding["verdict"]["oracle"] == "checkpoint" and finding["deterministic"] is True
    assert finding["verdict"]["first"]["quantity"] == "loaded.state.exp_avg"
    assert len(case["groups"]) == 1 and len(case["groups"][0]["params"]) == 2 and len(case["schedule"]) == 1, case
    buggy = run_cli("replay", found[0], setup=bug)
    assert buggy.returncode == 1 and f"FAIL: {finding['signature']}" in buggy.stdout, buggy.stdout
    replays_clean(found[0])
