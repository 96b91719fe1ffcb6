"""Activation checkpointing and dropout under ``ep`` (kernel/targets/ep.py): AC applied after ExpertParallel and
before fully_shard, per transformer block as torchtitan does (its recompute runs the MoE's all-to-alls again;
selective AC saves them), dropout from each rank's seed and replayed by the reference. Hand-written cases
replayed clean and with the planted recompute bugs: the finding's signature is checked."""
import dataclasses
import math

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from conftest import replay_clean_then_buggy
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel import ac, dropout
from fuzzshard.kernel.model import param_shapes


def ep_block_case(mesh, how="composable", fqns=("layers.1",), p=0.0, options=None, steps=2) -> Case:
    """A Linear, one transformer-like residual block (an MoE with a shared expert, top-2, and dropout of ``p``
    after it), a Linear; the block checkpointed (torchtitan's per-block AC) on ``mesh``."""
    world = math.prod(mesh)
    body = (Layer("moe", 4, 4, moe={"experts": 4, "hidden": 2, "shared": 2, "top_k": 2}),) + \
        ((Layer("dropout", p=p),) if p else ())
    model = Model(input="features", d_in=3, layers=(Layer("linear", 3, 4), Layer("residual", 4, 4, children=body),
                                                    Layer("linear", 4, 3)))
    opts = {**(options or {}), "ac": list(fqns), **({"ac_how": how} if how != "composable" else {})}
    case = Case(target="ep", world_size=world, mesh_shape=tuple(mesh), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),) * steps, batch=2 * world, seq=3,
                target_options=opts, seed=1)
    case.check()
    return case


def test_ep_draws_ac_and_dropout_only_with_the_flags():
    """With --ac / --dropout ep draws both (valid by construction); without, neither (its digest: test_draws)."""
    import fuzzshard.strategies as fst

    seen = {"ac": set(), "dropout": 0, "cases": 0}

    @hseed(46)
    @settings(max_examples=60, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="ep", world_sizes=[1, 2, 4], ac=True, dropout=True))
    def collect(case):
        assert case.refusal() is None
        seen["cases"] += 1
        if ac.ac_how(case.target_options):
            seen["ac"].add(ac.ac_how(case.target_options))
        seen["dropout"] += dropout.has_dropout(case.model)

    collect()
    assert len(seen["ac"]) >= 2 and seen["dropout"] >= 1, seen
    assert dataclasses.replace(ep_block_case((2,)), target_options={}).refusal() is None


def test_dropout_under_eps_tp_is_refused():
    """Under ep's tp the TP ranks draw one dp rank's masks: not the replay's one slice per rank of the world."""
    case = ep_block_case((2, 2), p=0.5)
    assert "dropout under ep's tp" in dataclasses.replace(case, target_options={"tp": True}).refusal()
    assert dataclasses.replace(ep_block_case((2, 2)), target_options={"tp": True}).refusal() is None


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["1d", "2d"])
def test_a_recompute_that_differs_from_the_forward_is_caught_under_ep(tmp_path, mesh):
    """The block (its MoE's dispatch and combine inside) checkpointed on a 1-D [ep] or 2-D [dp, ep] mesh (the
    experts FSDP-sharded over dp too): clean passes; the recompute fed a scaled input gives the block's grads wrong."""
    buggy = replay_clean_then_buggy(tmp_path, ep_block_case(mesh, "utils", steps=1), "ac_recompute_perturbed.py")
    assert "ep.parity.grad" in buggy and "layers.1.inner.0." in buggy, buggy


def test_a_recompute_that_draws_a_new_mask_is_caught_under_ep(tmp_path):
    """AC + dropout after the MoE: the reference replays each rank's masks (clean passes); a recompute that
    does not restore the generator differentiates another mask."""
    buggy = replay_clean_then_buggy(tmp_path, ep_block_case((2,), "composable", p=0.5, steps=1),
                                    "dropout_recompute_new_mask.py")
    assert "ep.parity.grad" in buggy, buggy


def ep_moe_case(mesh, how, p=0.0) -> Case:
    """test_ep's one MoE layer (a block of its own), checkpointed, dropout of ``p`` after it."""
    from test_ep import ep_case

    case = ep_case(mesh)
    model = dataclasses.replace(case.model, layers=case.model.layers + ((Layer("dropout", p=p),) if p else ()))
    case = dataclasses.replace(case, model=model, target_options={"ac": ["layers.0"], **(
        {"ac_how": how} if how != "composable" else {})})
    case.check()
    return case


def test_the_ep_script_writes_its_ac_or_falls_back_honestly():
    """A finding's script: AC between expert_parallel and fully_shard, as the kernel; selective AC, a
    CheckpointWrapper (renamed params) and dropout fall back saying why (the kernel's replay proves those)."""
    from test_ep import _grad_verdict
    from fuzzshard.scriptgen import fallback_reason, straight_script

    verdict = _grad_verdict("layers.0.experts.w1")
    for mesh, how, call in (((2, 2), "utils", "utils_checkpoint(f, *a, use_reentrant=False)"),
                            ((2,), "composable", "checkpoint(model.layers[0])")):
        case = ep_moe_case(mesh, how)
        assert fallback_reason(case, {}, verdict) is None
        src = straight_script(case, "ep", {}, verdict)
        assert call in src and src.count("\n") < 150 and "import fuzzshard" not in src, src.count("\n")
        assert src.index("expert_parallel(model") < src.index(call) < src.index("fully_shard(model")
    for how, p, why in (("sac", 0.0, "selective activation checkpointing"), ("wrapper", 0.0, "CheckpointWrapper renames"),
                        ("utils", 0.5, "dropout (its per-rank seeds")):
        assert why in fallback_reason(ep_moe_case((2,), how, p), {}, verdict)


def test_the_ep_script_finds_the_planted_recompute_and_passes_without(tmp_path):
    """The script on a 1-D ep mesh under torchrun: the recompute's perturbation (the MoE's dispatch and combine
    inside the checkpointed block) found in the experts' grads, clean torch passes."""
    from test_ep import _grad_verdict
    from test_scriptgen import finds_with_and_passes_without
    from fuzzshard.scriptgen import straight_script

    src = straight_script(ep_moe_case((2,), "utils"), "ep", {}, _grad_verdict("layers.0.experts.w1"))
    finds_with_and_passes_without(src, "ac_recompute_perturbed.py", "FINDING: the sharded run differs",
                                  "layers.0.experts.w1", "PASS: the sharded run matches", tmp_path)


def test_composable_ac_of_the_experts_is_the_known_torch_bug_not_fsdp2s_frozen_unit():
    """Composable checkpoint of an MoE's experts re-dispatches in its recompute (known
    composable-checkpoint-reruns-forward-pre-hooks); ep's fact tells it apart from the fsdp2 finding of that
    CheckpointError's signature, which any other ep case still meets through ep's known_as."""
    from fuzzshard.findings.record import known_signature, load_known

    known, sig = load_known(), "ep.error.fwdbwd.CheckpointError.bfe0c74e"
    experts = ep_moe_case((2,), "composable")
    experts = dataclasses.replace(experts, target_options={"ac": ["layers.0.experts"]})
    assert known[known_signature(sig, experts, known)].root_cause == "composable-checkpoint-reruns-forward-pre-hooks"
    assert known_signature(sig, ep_moe_case((2,), "composable"), known) == "fsdp2.error.fwdbwd.CheckpointError.bfe0c74e"
