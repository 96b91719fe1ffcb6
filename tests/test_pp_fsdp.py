"""The ``pp`` target composed as torchtitan composes it: FSDP2 on each stage over the dp sub-mesh of a [pp, dp]
mesh, and gradient accumulation (several schedule steps before the optimizer step): a clean seeded session that
draws both, the reference's accumulation with scale_grads (torch's stage.scale_grads divides the whole grad at
every step), and a planted FSDP2-under-PP bug caught on a hand-written case (found by a seeded session in the
slow tier)."""
import dataclasses

from conftest import run_cli
from test_pp import hunt_shrink_replay
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel.model import param_shapes
from fuzzshard.kernel.targets.pp import draws, schedules


def _case(schedule="GPipe", pp_degree=2, dp=2, n_microbatches=2, batch=4, accum=1, scale_grads=True) -> Case:
    model = Model("features", 3, tuple(Layer("linear", 3, 3) for _ in range(4)))
    o = {"schedule": schedule, "cuts": [round(i * 4 / pp_degree) for i in range(1, pp_degree)],
         "scale_grads": scale_grads, "n_microbatches": n_microbatches}
    mesh = (pp_degree,)
    if dp > 1:
        o.update(dp=dp, reshard_after_forward=False)
        mesh = (pp_degree, dp)
    if accum > 1:
        o["accum"] = accum
    return Case(target="pp", world_size=pp_degree * dp, mesh_shape=mesh, model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),), batch=batch, seq=2, target_options=o)


def test_pp_fsdp_check_and_objective():
    """dp is the mesh's second dim and divides the batch; accum divides each dp rank's slice; the reference's
    objective with scale_grads divides the accumulated loss by n_microbatches at every step (stage.scale_grads
    divides the whole p.grad, the earlier steps' part too), mean over the dp slices."""
    import torch

    assert draws.check(_case()) is None and draws.check(_case(dp=1, accum=2)) is None
    assert "second dim" in draws.check(dataclasses.replace(_case(), target_options={**_case().target_options, "dp": 3}))
    assert "equal slice" in draws.check(dataclasses.replace(_case(), batch=3))
    assert "accum" in draws.check(_case(dp=2, accum=3, n_microbatches=1))
    assert schedules.n_stages(_case().target_options, 4) == 2 and schedules.stage_ranks(_case().target_options, 4) == [0, 1]
    # fitted to a 1-D mesh, FSDP2's options go; to a 2-D one, dp follows its second dim
    assert "dp" not in draws.fit_options(dict(_case().target_options), [2], 1)
    assert draws.fit_options(dict(_case(dp=1).target_options), [2, 2], 1)["dp"] == 2
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x = torch.arange(8, dtype=torch.float32).view(8, 1)
    y = torch.zeros(8, 1)
    o = {"n_microbatches": 2, "scale_grads": True, "accum": 2, "dp": 2}
    loss = schedules.pp_objective(lin, x, y, o)
    # dp slice [0..3]: steps [0,1] and [2,3], microbatches of one sample: ((0 + 1) / 2 + 4 + 9) / 2; [4..7] alike
    want = (((0 + 1) / 2 + 4 + 9) / 2 + ((16 + 25) / 2 + 36 + 49) / 2) / 2
    assert abs(loss.item() - want) < 1e-5, (loss.item(), want)


def test_pp_fsdp_and_accumulation_clean_session(tmp_path):
    """A seeded session at world sizes 2 and 4 draws FSDP2 on a [2, 2] mesh and gradient accumulation (with
    scale_grads) among its passing cases, and finds nothing new on clean torch (the torch bugs it meets are
    known ones)."""
    out = tmp_path / "out"
    # seed 6 (7 until pp drew ep on [pp, dp] meshes: the draws after a 2-D MoE case moved)
    r = run_cli("fuzz", "--target", "pp", "--max-examples", 20, "--seed", 6, "--world-sizes", "2,4",
                "--optimizers", "SGD", "--checkpoints", "none", "--case-timeout", 60, "--shrink-budget", "20s",
                "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    text = r.stdout + r.stderr
    line = next(ln for ln in text.splitlines() if ln.startswith("passing schedule x world:"))
    assert "FSDP2 [2,2]" in line, line
    accum = next(ln for ln in text.splitlines() if ln.startswith("passing accum x scale_grads:"))
    assert "accum 2" in accum or "accum 3" in accum, accum
    assert not list(out.glob("pp.*.json"))


def test_planted_fsdp_reduce_sum_under_pp_is_found_and_replays(tmp_path):
    """Under PP, the last stage's FSDP2 reduce over dp sums the dp ranks' grads instead of averaging them: a
    short session at world size 4 finds it as a grad parity finding on a [2, 2] mesh (dp 2), in the last
    stage's params only; it replays as itself with the bug and passes on unmodified torch."""
    # seed 1 (0 until pp drew ep on [pp, dp] meshes: the draws after a 2-D MoE case moved)
    finding = hunt_shrink_replay(tmp_path, "pp_fsdp_last_stage_reduce_sum.py", 1, 8, "15s", world_sizes="4")
    case = finding["case"]
    o = case["target_options"]
    assert case["mesh_shape"] == [2, 2] and o["dp"] == 2, case
    last = o["cuts"][-1]  # the last stage's first top-level layer (pp degree 2, one stage a rank)
    fqns = {m["fqn"] for m in finding["verdict"]["mismatches"] if m.get("quantity") == "grad"}
    assert fqns and all(int(n.split(".")[1]) >= last for n in fqns), (fqns, o)


def test_planted_fsdp_reduce_sum_under_pp_is_caught_on_a_hand_written_case(tmp_path):
    """The same bug on a hand-written case (GPipe over 2 stages, FSDP2 over dp 2 on a [2, 2] mesh, the module's
    _case): passes on unmodified torch, a grad parity finding in the last stage's params with the bug. The
    session above (the slow tier) proves it is found and shrunk; pp's search and shrinking stay proven in the
    default tier by test_pp.py's 1F1B session."""
    import re

    from conftest import replay_clean_then_buggy

    case = _case()
    buggy = replay_clean_then_buggy(tmp_path, case, "pp_fsdp_last_stage_reduce_sum.py")
    assert "FAIL: pp.parity.grad" in buggy, buggy
    last = case.target_options["cuts"][-1]
    named = {int(n) for n in re.findall(r"grad layers\.(\d+)\.", buggy)}
    assert named and min(named) >= last, (named, buggy)  # the last stage's params only
