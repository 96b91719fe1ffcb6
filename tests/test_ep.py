"""The ``ep`` target: expert parallelism (torchtitan's ExpertParallel token dispatch and combine with
all_to_all_single_autograd, experts Shard(0) over the ep mesh dim) + FSDP2. Hand-written cases replayed
clean and with each planted bug: the finding's signature is checked, not just the exit code."""
import math

import pytest

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step

from conftest import replays_clean, run_cli


def ep_case(mesh, moe=None, options=None, steps=2) -> Case:
    """One MoE layer (kernel/moe.py: 4 experts of hidden 2 over 3 features) on ``mesh``, SGD, two steps."""
    import math

    from fuzzshard.kernel.model import param_shapes

    world = math.prod(mesh)
    model = Model(input="features", d_in=3, layers=(Layer("moe", 3, 3, moe={"experts": 4, "hidden": 2, **(moe or {})}),))
    case = Case(target="ep", world_size=world, mesh_shape=tuple(mesh), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),) * steps, batch=2 * world, seq=3,
                target_options=options or {}, seed=1)
    case.check()
    return case


def replay_both(tmp_path, case, bug):
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    replays_clean(path)
    buggy = run_cli("replay", path, setup=bug)
    assert buggy.returncode == 1, buggy.stdout + buggy.stderr[-2000:]
    return buggy.stdout


def test_ep_rules():
    """Experts must divide over the EP degree (the mesh's last dim); dropless only; an MoE is needed."""
    import pytest

    from fuzzshard.case import CaseError

    with pytest.raises(CaseError, match="do not divide over the EP degree 3"):
        ep_case((3,))
    with pytest.raises(CaseError, match="capacity factor"):
        ep_case((2,), {"capacity": 1.0})
    assert ep_case((2, 2)).mesh_shape == (2, 2)


def test_a2a_split_off_by_one_is_found_on_1d_ep(tmp_path):
    """The tokens' all-to-all offsets one row late: the loss is the first to differ, and the experts' and the
    router's grads after it."""
    out = replay_both(tmp_path, ep_case((2,)), "ep_a2a_split_off_by_one.py")
    assert "FAIL: ep.parity.loss" in out, out
    assert "grad layers.0.experts.w1" in out, out


def test_router_grad_unreduced_over_dp_is_found_on_2d_ep(tmp_path):
    """The router's own FSDP unit on a 2-D [dp, ep] mesh, its grads not all-reduced over dp: at step 0 the
    router's grad alone differs (the experts' and shared experts' reductions are right; from step 1 the dp
    replicas route with routers that stepped apart, and the experts' grads follow)."""
    case = ep_case((2, 2), {"shared": 2, "top_k": 2}, {"wrap": ["layers.0.router"], "reshard_after_forward": False})
    out = replay_both(tmp_path, case, "ep_router_grad_unreduced_over_dp.py")
    assert "FAIL: ep.parity.grad" in out and "grad of layers.0.router.gate.weight" in out, out
    assert not any(f"{w} step 0" in out for w in ("experts.w1", "experts.w2", "experts.w3")), out
    assert "shared_experts" not in out, out


def test_aux_loss_and_routing_bias_pass_clean(tmp_path):
    """A sequence-wise aux loss (its grad of one, torchtitan's) and a routing bias, on a 1-D ep mesh: the
    grads are averaged over the ranks as the loss is (a clean session once met the router's grad twice the
    reference's: the target summed the grads of a loss it divided by the ranks, the aux loss's undivided)."""
    path = tmp_path / "case.json"
    path.write_text(ep_case((2,), {"aux": "seq", "bias_coeff": 0.25, "top_k": 2}).to_json())
    replays_clean(path)


def _grad_verdict(fqn):
    from fuzzshard.verdict import Verdict, finding

    return Verdict.from_dict(finding("parity", [{"quantity": "grad", "fqn": fqn, "step": 0, "detail": "x"}]))



@pytest.mark.parametrize("mesh, bug, fqn", [((2,), "ep_a2a_split_off_by_one.py", "layers.0.experts.w1"),
                                            ((2, 2), "ep_router_grad_unreduced_over_dp.py", "layers.0.router.gate.weight")],
                         ids=["a2a_1d", "router_2d"])
def test_the_straight_line_script_writes_the_dispatch_and_finds_each_plant(tmp_path, mesh, bug, fqn):
    """A finding's script (scriptgen/ep.py, < 150 lines, torch only): the MoE and torchtitan's ExpertParallel
    dispatch/combine written out, its fully_shard units; under torchrun it fails with the planted bug where the
    grad differs, and passes on torch as it is."""
    from conftest import PLANTED, torchrun
    from fuzzshard.scriptgen import fallback_reason, straight_script

    case = ep_case(mesh, {"shared": 2, "top_k": 2}, {"wrap": ["layers.0.router"], "reshard_after_forward": False})
    verdict = _grad_verdict(fqn)
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "ep", {}, verdict)
    assert src.count("\n") < 150 and "import fuzzshard" not in src, src.count("\n")
    assert "all_to_all_single_autograd" in src and "distribute_module(m.experts" in src
    (tmp_path / "repro.py").write_text(src)
    world = math.prod(mesh)
    buggy = torchrun(tmp_path / "repro.py", world, "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode == 1 and f"step 0 grad {fqn}: sharded" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", world, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_a_config_the_script_does_not_write_falls_back_honestly():
    from fuzzshard.scriptgen import fallback_reason

    assert "aux" in fallback_reason(ep_case((2,), {"aux": "seq"}), {}, _grad_verdict("layers.0.router.gate.weight"))
