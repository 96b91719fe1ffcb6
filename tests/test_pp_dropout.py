"""Dropout under ``pp`` (kernel/dropout.py, docs/oracles.md "Dropout"): each stage's rank draws its masks from
its own seed, its stage's forwards in microbatch order (GPipe, 1F1B; LoopedBFS: its stages one after another);
the reference replays them stage after stage (kernel/targets/pp/schedules.py ``replayed_stages``). The schedules
that interleave a rank's stages are refused; a planted stage that forks the generator around each microbatch's
forward is caught as a loss parity finding, and the recompute that draws a new mask under AC as a grad one."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from conftest import replay_clean_then_buggy
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel import dropout
from fuzzshard.kernel.model import build_model, param_shapes
from fuzzshard.kernel.targets.pp import schedules
from fuzzshard.scriptgen.plan import fallback_reason

# the residual block's dropout lands on the second stage (cuts [2]), the top-level one on the last
MODEL = Model("features", 5, (
    Layer("linear", 5, 7), Layer("act", act="tanh"),
    Layer("residual", 7, 7, children=(Layer("linear", 7, 4), Layer("act", act="relu"), Layer("linear", 4, 7),
                                      Layer("dropout", p=0.5))),
    Layer("linear", 7, 3), Layer("dropout", p=0.25)))


def pp_case(schedule="GPipe", mesh=(2,), n=2, batch=4, cuts=(2,), stages=1, model=MODEL, **extra) -> Case:
    o = {"schedule": schedule, "cuts": list(cuts), "scale_grads": True, "n_microbatches": n, **extra}
    if stages > 1:
        o["stages"] = stages
    if len(mesh) == 2:
        o["dp"] = mesh[1]
    case = Case(target="pp", world_size=mesh[0] * (mesh[1] if len(mesh) == 2 else 1), mesh_shape=tuple(mesh),
                model=model, optim=Optim("Adam", {"lr": 0.01}), groups=(Group(tuple(param_shapes(model))),),
                schedule=(Step(),) * 2, batch=batch, seq=3, target_options=o)
    case.check()
    return case


def test_pp_draws_dropout_with_the_flag_on_the_schedules_whose_masks_are_replayed():
    """With --dropout pp draws it (valid by construction: a schedule that interleaves a rank's stages keeps its
    case without); without, never (pp's digest: test_draws). The interleaved schedules are refused with it."""
    import fuzzshard.strategies as fst

    seen = {"dropout": 0, "schedules": set()}

    @hseed(46)
    @settings(max_examples=40, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="pp", world_sizes=[2, 4], dropout=True))
    def collect(case):
        assert case.refusal() is None
        if dropout.has_dropout(case.model):
            seen["dropout"] += 1
            seen["schedules"].add(case.target_options["schedule"])
            assert dropout.mode(case) == "replay" and case.target_options["schedule"] in schedules.DROPOUT_SCHEDULES

    collect()
    assert seen["dropout"] >= 2, seen
    refused = dataclasses.replace(pp_case(), target_options={**pp_case().target_options, "schedule": "Interleaved1F1B",
                                                             "stages": 2, "cuts": [1, 2, 3]})
    assert "dropout under ScheduleInterleaved1F1B" in refused.refusal()
    assert "dropout" in fallback_reason(pp_case())  # the straight-line script does not write the stage replay
    assert dropout.dropout_coverage(pp_case(ac=["layers.2"]))["dropout"].keys() >= {"replay", "checkpointed", "microbatches"}


@pytest.mark.parametrize("options", [
    {"schedule": "GPipe", "cuts": [2], "n_microbatches": 2},
    {"schedule": "1F1B", "cuts": [1], "n_microbatches": 2, "dp": 2, "accum": 2},
    {"schedule": "LoopedBFS", "cuts": [1, 2, 3], "stages": 2, "n_microbatches": 3},
], ids=["gpipe", "1f1b-dp-accum", "looped-bfs"])
def test_without_masks_the_stage_replay_is_the_whole_models_objective(options):
    """The stages compose to the whole model: where no mask is drawn (eval: dropout off) the replay stage after
    stage is pp_objective bit for bit, and its grads too."""
    options = {"scale_grads": True, **options}
    model = build_model(MODEL, 0, "cpu", torch.float32).eval()
    x, y = torch.randn(8, 3, 5), torch.randn(8, 3, 3)
    case = pp_case()
    with dropout.replaying(case, 0, "cpu"):
        replayed = schedules.replayed_stages(model, x, y, options, dropout.draws())
    grads = torch.autograd.grad(replayed, list(model.parameters()))
    whole = schedules.pp_objective(model, x, y, options)
    assert torch.equal(replayed, whole)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(whole, list(model.parameters()))))


def test_a_looped_bfs_clean_replay_passes(fuzz_pool):
    """LoopedBFS on 2 ranks, 2 stages each (cuts [2, 3, 4]): rank 1 draws stage 1's masks (the residual block's),
    then stage 3's (the top-level dropout) from where stage 1 left its generator; the replay follows."""
    from fuzzshard.findings.judge import judge

    verdict = judge(fuzz_pool, pp_case("LoopedBFS", cuts=(2, 3, 4), stages=2)).verdict
    assert verdict.status == "pass", verdict


def test_a_stage_that_forks_its_generator_per_microbatch_is_caught(tmp_path):
    """GPipe on 2 ranks, 2 microbatches: clean passes (each stage's masks replayed from its rank's seed); a stage
    whose forward gives the generator back after each microbatch draws the first microbatch's masks twice."""
    buggy = replay_clean_then_buggy(tmp_path, pp_case(), "pp_stage_forward_forks_rng.py")
    assert "FAIL: pp.parity.loss" in buggy and "grad layers.0.weight step 0" in buggy, buggy


def test_a_recompute_that_draws_a_new_mask_is_caught_under_pp_on_pp_dp(tmp_path):
    """1F1B on a [pp, dp] = [2, 2] mesh (FSDP2 over dp), the residual block checkpointed: clean passes (each of the
    4 ranks' masks from its own seed); a recompute that does not restore the generator differentiates another
    mask, and moves the generator on: under 1F1B the last stage's first backward (its recompute) runs before its
    second microbatch's forward, whose masks are others then too: the loss differs first, the block's grads with it."""
    case = dataclasses.replace(pp_case("1F1B", mesh=(2, 2), batch=8, ac=["layers.2"]), schedule=(Step(),))
    buggy = replay_clean_then_buggy(tmp_path, case, "dropout_recompute_new_mask.py")
    assert "FAIL: pp.parity.loss" in buggy and "grad layers.2.inner" in buggy, buggy
