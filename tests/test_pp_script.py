"""The pp target's straight-line repro (fuzzshard/scriptgen/pp.py): each pp
planted bug's shrunk case gets a short torch-only script (no fallback to the
flattened kernel) that builds the kernel's model and data; the GPipe planted
bug's script fails standalone under torchrun with the bug and passes without
it; a seeded session finds that bug and shrinks it (the slow tier)."""
import dataclasses
import json

import pytest

from conftest import PLANTED, run_cli, torchrun
from fuzzshard.case import Case, Checkpoint, Group, Layer, LRScheduler, Model, Optim, Step
from fuzzshard.kernel.model import build_model, make_batch, param_shapes
from fuzzshard.scriptgen import fallback_reason, straight_script
from fuzzshard.verdict import Mismatch, Verdict
from test_scriptgen import _defs

import torch

LINES = 125  # a pp finding's script, the grads of one step compared, aims at 120 (ci/script_table.py measures the known ones)


def _case(name, world, n_microbatches, stages=1, layers=2, scale_grads=False, **kw) -> Case:
    model = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(layers)))
    o = {"schedule": name, "cuts": [round(i * layers / (world * stages)) for i in range(1, world * stages)],
         "scale_grads": scale_grads, "n_microbatches": n_microbatches, **({"stages": stages} if stages > 1 else {})}
    case = Case(target="pp", world_size=world, mesh_shape=(world,), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),), batch=4, seq=2, target_options=o)
    return dataclasses.replace(case, **kw)


GRAD = Verdict("finding", "parity", first=Mismatch("grad", "layers.0.weight", 0, ""))

# each pp planted bug and the case its session shrinks to (tests/test_pp.py), the schedule class it runs
SHRUNK = [
    ("pp_1f1b_drop_microbatch_grads.py", _case("1F1B", 2, 2), "Schedule1F1B(stages[0]"),
    ("pp_zero_bubble_dw_twice.py", _case("InterleavedZeroBubble", 1, 1, stages=2), "ScheduleInterleavedZeroBubble(stages"),
    ("pp_looped_stage_scale.py", _case("Interleaved1F1B", 1, 2, stages=2, scale_grads=True), "ScheduleInterleaved1F1B(stages"),
    ("pp_gpipe_last_microbatch_only.py", _case("GPipe", 1, 2, layers=1), "ScheduleGPipe(stages[0]"),
    # two ranks, two groups (one per stage, the second with its own lr), Adam, two steps: every rank's optimizer
    # holds its own group, the groups gathered in the case's order
    ("", _case("GPipe", 2, 2, scale_grads=True, optim=Optim("Adam", {"lr": 0.01}),
               groups=(Group(("layers.0.weight", "layers.0.bias")), Group(("layers.1.weight", "layers.1.bias"), {"lr": 0.1})),
               schedule=(Step(), Step(set_to_none=False))), "ScheduleGPipe(stages[0]"),
]


def test_pp_planted_bugs_get_a_short_straight_script_with_the_kernels_model_and_data():
    for bug, case, schedule in SHRUNK:
        assert fallback_reason(case, None, GRAD) is None, (bug, fallback_reason(case, None, GRAD))
        src = straight_script(case, bug, None, GRAD if bug else None)
        assert src.count("\n") < LINES + 30 * (not bug), (bug, src.count("\n"))
        assert schedule in src and "import fuzzshard" not in src and "CASE_JSON" not in src
        ns = _defs(src)
        got, want = ns["build"](case.seed).state_dict(), build_model(case.model, case.seed, "cpu", torch.float32).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want) and list(got) == list(want)
        x, y = ns["batch"](0)
        x0, y0 = make_batch(case.model, case.seed, 0, case.batch, case.seq, "cpu", torch.float32)
        assert torch.equal(x, x0) and torch.equal(y, y0)


def _ckpt_case(split=False) -> Case:
    """Saved on 2 ranks (GPipe, a stage each), loaded on 1 (both stages): two same-shaped weights in one group."""
    model = Model("features", 3, tuple(Layer("linear", 3, 3, bias=False) for _ in range(2)))
    loading = {"schedule": "GPipe", "cuts": [], "scale_grads": False, "n_microbatches": 2}
    return Case(target="pp", world_size=2, mesh_shape=(2,), model=model, optim=Optim("Adam", {"lr": 0.01}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(), Step()), batch=2, seq=2,
                target_options={"schedule": "GPipe", "cuts": [1], "scale_grads": False, "n_microbatches": 2},
                checkpoint=Checkpoint(0, "dcp", 1, (1,), split=split, target_options=loading))


CKPT = Verdict("finding", "checkpoint", first=Mismatch("loaded.state.exp_avg", "layers.0.weight", 0, ""))


def test_a_pp_checkpoint_is_written_as_torchtitans_at_each_sides_pp_degree():
    """pp's dcp kind (kernel/targets/pp/checkpoint.py save / load): each rank's model part and its flattened optimizer state
    dict, by plain FQN, in one DCP checkpoint; the loading side's pipeline at its own world size (one rank: both
    stages), its part filled by dcp.load and set back (split or not)."""
    case = _ckpt_case()
    assert fallback_reason(case, None, CKPT) is None
    src = straight_script(case, "", None, CKPT)
    saving, loading = src.split("# the loading side")
    assert "on = [0, 1]" in saving and "on = [0]" in loading and "if rank < 1:" in loading  # each side's own layout
    assert "part.layers = nn.ModuleDict({str(i): model.layers[i] for s, at in enumerate(on) if at == rank" in src
    assert "sd = {\"model\": get_model_state_dict(part), \"optim\": get_optimizer_state_dict(part, opt, options=FLAT)}" in saving
    assert "dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt), process_group=group)" not in saving  # all ranks save
    assert "dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt), process_group=group)" in loading
    assert "set_state_dict(part, opt, model_state_dict=sd[\"model\"], optim_state_dict=sd[\"optim\"]" in loading
    assert "saved = snapshot(model, opt)" in saving and "loaded = snapshot(model, opt)" in loading
    split = straight_script(_ckpt_case(split=True), "", None, CKPT)
    assert "set_optimizer_state_dict(part, opt, sd[\"optim\"], options=StateDictOptions(flatten_optimizer_state_dict=True))" in split
    assert src.count("\n") < 150 and "CASE_JSON" not in src and fallback_reason(_ckpt_case()) is None


def test_a_pp_checkpoints_script_shows_its_planted_bug_and_passes_without(tmp_path):
    """DSD's unflatten of the flattened optimizer state dict loads two same-shaped params' state under each other's
    FQN (tests/planted/pp_ckpt_state_wrong_fqn.py): the round trip's script names the swapped state with the bug
    (exit 1) and passes without (exit 0)."""
    case = _ckpt_case()
    script = tmp_path / "repro.py"
    script.write_text(straight_script(case, "planted", None, CKPT))
    buggy = torchrun(script, 2, "--setup", PLANTED / "pp_ckpt_state_wrong_fqn.py", cwd=tmp_path)
    assert buggy.returncode == 1 and "FINDING: the load changed what was saved" in buggy.stdout and \
        "state layers.0.weight.exp_avg: saved " in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(script, 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS: the loaded state equals the saved one" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_pp_options_the_script_does_not_write_fall_back_with_the_reason():
    case = SHRUNK[0][1]
    cuda = dataclasses.replace(case, device="cuda")
    assert "on cuda" in fallback_reason(cuda) and straight_script(cuda) is None
    added = dataclasses.replace(case, optim=dataclasses.replace(case.optim, added_groups=1),
                                groups=(Group(("layers.0.weight", "layers.0.bias")), Group(("layers.1.weight", "layers.1.bias"))))
    assert "added after the constructor" in fallback_reason(added)
    # an LR scheduler is written (each rank's over its own groups, their lrs put in the case's order); Plateau fed
    # the last stage's loss, sent to every rank
    sched = dataclasses.replace(SHRUNK[-1][1], lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}))
    src = straight_script(sched)
    assert "StepLR(opt, " in src and "StepLR(opt_p, " in src and "in_case_order([float(v) for v in sched.get_last_lr()])" in src
    plateau = straight_script(dataclasses.replace(case, lr_scheduler=LRScheduler("ReduceLROnPlateau", {})))
    assert "schedule.step(target=y, losses=losses)" in plateau and "sched.step(full_loss)" in plateau


def test_a_pp_planted_bugs_script_fails_standalone_with_it_and_passes_without(tmp_path):
    """GPipe keeps only the last microbatch's param grads: the script of its shrunk case (GPipe on one rank, two
    microbatches, one step) prints FINDING and the grads (exit 1) under torchrun with the bug planted, and PASS
    (exit 0) on torch as it is. (test_pp.py runs the 1F1B finding's script the same way.)"""
    bug, case, _ = SHRUNK[3]
    script = tmp_path / "repro.py"
    script.write_text(straight_script(case, bug, None, GRAD))
    buggy = torchrun(script, case.world_size, "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode == 1 and "FINDING" in buggy.stdout and "step 0 grad layers.0.weight" in buggy.stdout, \
        buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(script, case.world_size, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


# the slow tier (a fuzz session, ~60 s on CI's 2 cores): test_pp.py's three pp sessions prove the search and the
# shrinking on pp in the default tier, and bench --hunt finds this bug in seconds (tests/planted/hunt.json)
@pytest.mark.slow
def test_planted_gpipe_bug_is_found_by_a_session_and_shrunk(tmp_path):
    """A short pp session finds GPipe's lost microbatch grads as a grad parity finding, confirmed and
    deterministic, shrunk to GPipe on one rank, two microbatches (one would hide it), one step, with a
    straight-line script."""
    bug, out = "pp_gpipe_last_microbatch_only.py", tmp_path / "out"
    r = run_cli("fuzz", "--target", "pp", "--max-examples", 10, "--seed", 1, "--world-sizes", "2", "--optimizers", "SGD",
                "--checkpoints", "none", "--case-timeout", 60, "--shrink-budget", "20s", "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("pp.*.json"))
    assert [p.name for p in found] == ["pp.parity.grad.json"], f"{[p.name for p in found]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    case, o = finding["case"], finding["case"]["target_options"]
    assert finding["stage"] == "confirmed" and finding["deterministic"] is True
    assert o["schedule"] == "GPipe" and o["n_microbatches"] == 2 and case["world_size"] == 1, case
    assert len(case["schedule"]) == 1
    script = found[0].with_suffix(".py").read_text()
    assert "CASE_JSON" not in script and "ScheduleGPipe(stages[0]" in script and script.count("\n") < LINES


def test_pp_with_fsdp2_and_accumulation_gets_a_straight_script():
    """FSDP2 on a [pp, dp] mesh (torchtitan's composition: the wrap layers, then each stage, fully_shard-ed over
    dp; the pipeline over this dp index's pp ranks; each dp rank on its slice) and accum schedule steps: written
    straight-line, the plain objective the mean over the dp slices of each slice's accumulated one. (Under
    torchrun on 4 ranks: PASS on clean torch, FINDING with pp_fsdp_last_stage_reduce_sum.py, as fuzzshard replay
    says; measured by hand, not rerun here.)"""
    model = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(3)), buffer=True)
    o = {"schedule": "1F1B", "cuts": [2], "scale_grads": True, "n_microbatches": 2, "dp": 2,
         "reshard_after_forward": False, "wrap": ["layers.0"], "accum": 2}
    case = Case(target="pp", world_size=4, mesh_shape=(2, 2), model=model, optim=Optim("Adam", {"lr": 0.01}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),), batch=8, seq=2, target_options=o)
    assert fallback_reason(case, None, GRAD) is None, fallback_reason(case, None, GRAD)
    src = straight_script(case, "", None, GRAD)
    assert "fully_shard(model.layers[i], mesh=mesh[\"d1\"], reshard_after_forward=False)" in src
    assert "xd, yd = x.tensor_split(2)[dp_rank], y.tensor_split(2)[dp_rank]" in src and "if pp_rank == 0:" in src
    assert "for xs, ys in zip(x.tensor_split(2), y.tensor_split(2))) / 2)" in src and "full(q.grad)" in src
    assert len(src.splitlines()) <= 170
