"""dcp.async_save in a checkpoint case (Checkpoint.async_save, kernel/state_io.py): where it is possible, how
training goes on while it runs (the saved tensors changed in place, then put back bit for bit), what the
strategies draw, the straight-line script's async forms, and the planted staging bug (tests/planted/
async_save_stages_late.py) that proves the loaded oracle catches a copy taken after the call returned."""
import dataclasses
import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import simple_case
from conftest import PLANTED, replays_clean, run_cli, torchrun
from fuzzshard.case import Checkpoint
from fuzzshard.kernel import state_io
from fuzzshard.kernel.state_io import ASYNC_SAVES, async_save_problem
from fuzzshard.scriptgen import straight_script
from strategies import checkpoints
from fuzzshard.kernel.model import param_shapes


def _case(how="thread", kind="dcp", device="cpu"):
    ck = Checkpoint(after=1, kind=kind, world_size=1, mesh_shape=(1,), async_save=how)
    return dataclasses.replace(simple_case(world=2), checkpoint=ck, device=device)


def test_async_save_is_a_dcp_save_on_cpu_with_a_known_form():
    for how in ASYNC_SAVES:
        assert async_save_problem(_case(how)) is None
    assert async_save_problem(_case("")) is None and async_save_problem(_case("", kind="full")) is None
    assert "one of" in async_save_problem(_case("process"))
    assert "'full' checkpoint saves otherwise" in async_save_problem(_case("thread", kind="full"))
    assert "NCCL only" in async_save_problem(_case("stager", device="cuda"))


def test_training_goes_on_changes_every_saved_tensor_and_puts_it_back_bit_for_bit():
    w = torch.randn(3, 4)
    tied = {"a.weight": w, "b.weight": w}  # one tensor held twice: changed once
    sd = {"model": {**tied, "empty": torch.zeros(0), "mask": torch.tensor([True, False])},
          "optim": {"state": {"a.weight": {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), -0.0)}},
                    "param_groups": [{"lr": 0.1, "params": ["a.weight"]}]}}
    before = {k: v.clone() for k, v in [("w", w), ("mask", sd["model"]["mask"]),
                                         ("step", sd["optim"]["state"]["a.weight"]["step"])]}
    with state_io._changed(sd):
        assert torch.equal(w, before["w"] + 1)  # +1 once, though held twice
        assert torch.equal(sd["model"]["mask"], ~before["mask"])
        assert sd["optim"]["state"]["a.weight"]["step"].item() == 4.0
        assert torch.equal(sd["optim"]["state"]["a.weight"]["exp_avg"], torch.ones(3, 4))
    assert torch.equal(w, before["w"]) and torch.equal(sd["model"]["mask"], before["mask"])
    assert sd["optim"]["state"]["a.weight"]["step"].item() == 3.0
    assert torch.equal(sd["optim"]["state"]["a.weight"]["exp_avg"], torch.full((3, 4), -0.0))
    assert torch.signbit(sd["optim"]["state"]["a.weight"]["exp_avg"]).all()  # -0.0 back, bit for bit


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_only_a_dcp_checkpoint_draws_an_async_save_and_only_when_asked(data):
    case = simple_case(world=2)
    shapes = param_shapes(case.model)
    asked = data.draw(st.booleans())
    ck = data.draw(checkpoints("dtensor", [1, 2], 2, shapes, async_saves=asked))
    if not asked or ck.kind != "dcp":
        assert ck.async_save == ""
    else:
        assert ck.async_save in ("", *ASYNC_SAVES)


def test_the_straight_line_script_saves_asynchronously_in_each_form():
    for how in ASYNC_SAVES:
        text = straight_script(_case(how))
        assert text and "dcp.async_save(" in text and "restore = training_goes_on(sd)" in text, how
        assert ("checkpoint_id=ckpt" in text) == (how == "thread")
        assert ("async_stager=stager" in text) == (how in ("stager", "pinned"))
        compile(text, f"{how}.py", "exec")
    assert "async_save" not in straight_script(_case(""))


def test_planted_async_save_staging_late_is_found_shrunk_and_replays(tmp_path):
    """dcp.async_save whose staging copies no CPU tensor (pytorch/pytorch#144657 as torch had it): the upload writes
    the state as training changed it after the call returned. Found by the loaded oracle under each async form
    (the file-system writer's own staging, torch's DefaultStager, a kept DefaultStager, pinned), shrunk to a
    1-rank case that still saves asynchronously (a blocking save passes), replaying through fuzzshard and
    standalone. Seed 1 draws an async save within 10 examples."""
    bug = "async_save_stages_late.py"
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "dtensor", "--loop", "async_save", "--checkpoints", "all", "--max-examples", 10,
                "--shrink-budget", "10s", "--seed", 1, "--world-sizes", 1, "--optimizers", "SGD", "--case-timeout", 60,
                "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("dtensor.checkpoint.dcp_async.loaded.*.json"))
    assert len(found) == 1, f"{[p.name for p in out.glob('*.json')]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    case = finding["case"]
    assert finding["verdict"]["oracle"] == "checkpoint" and finding["deterministic"] is True
    assert case["checkpoint"]["async_save"] in ("thread", "writer", "stager", "pinned"), case["checkpoint"]
    assert len([x for x in case["model"]["layers"] if x["kind"] != "act"]) <= 2 and len(case["schedule"]) <= 2
    buggy = run_cli("replay", found[0], setup=bug)
    assert buggy.returncode == 1 and f"FAIL: {finding['signature']}" in buggy.stdout, buggy.stdout
    replays_clean(found[0])
    script = found[0].with_suffix(".py")  # the straight-line script saves asynchronously too, and shows the bug
    assert "dcp.async_save(" in script.read_text()
    buggy = torchrun(script, case["world_size"], "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode != 0 and "FINDING" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    # (not its clean run under torchrun too: one torchrun less keeps this test near a minute; the clean replay
    # above runs the same case, and every form's script compiles, test_the_straight_line_script_...)
