"""The training loop (issue 38: clipping, LR schedulers, grad scaling) on
fsdp1, fsdp2, zero and sharded_optim: a hand-made case per target and
feature passes on stock torch, and a planted ShardedGradScaler that steps
on an inf is caught (its skip is checked). One pool of 2 ranks per run."""
import dataclasses

import pytest

from fuzzshard.case import Case, CaseError, Clip, Group, Layer, LRScheduler, Model, Optim, Overflow, Scaler, Step
from fuzzshard import targets
from fuzzshard.pool.options import PoolOptions
from fuzzshard.pool.runner import Pool

from conftest import PLANTED

MODEL = Model("features", 5, (Layer("linear", 5, 7), Layer("act", act="tanh"), Layer("linear", 7, 3)))
NAMES = ("layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias")
# an overflow drawn on purpose at step 1 (skipped on every rank), a scale that grows every clean step
SCALER = Scaler(init_scale=2.0 ** 8, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, overflow=(1,))
DDP = {"broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False,
       "static_graph": False}

# issue 45: an overflow in some grads only, at step 1 in place of the loss's: one element of one param's grad,
# on the ranks whose shard holds it (flat index 34 of layers.0.weight, 7 x 5: the last row, rank 1's under a
# dim-0 split in 2; index 30 of FSDP1's flat param, 66 elements in 2 shards of 33: rank 0's), or a whole grad
def partial(param, index=0, value="inf", layer=False) -> Scaler:
    return dataclasses.replace(SCALER, overflow=(), overflow_at=Overflow(1, param, index, value, layer))


def _case(target, options, groups=None, **loop) -> Case:
    return Case(target=target, world_size=2, mesh_shape=(2,), model=MODEL,
                optim=Optim("Adam", {"lr": 0.01, "weight_decay": 0.1}),
                groups=groups or (Group(NAMES[:2]), Group(NAMES[2:], {"lr": 0.02})),
                schedule=(Step(), Step(), Step()), batch=4, seq=2, target_options=options, **loop)

CASES = {
    # FSDP.clip_grad_norm_ over orig params, a scheduler, ShardedGradScaler
    "fsdp1_own": _case("fsdp1", {"strategy": "FULL_SHARD", "orig_params": True, "wrap": []},
                       clip=Clip("own", 0.1, "2"), lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}),
                       scaler=SCALER),
    # clip_grad_value_ on the flat params' sharded grads
    "fsdp1_flat_value": _case("fsdp1", {"strategy": "SHARD_GRAD_OP", "orig_params": False, "wrap": []},
                              groups=(Group(NAMES),), clip=Clip("value", 1e-3),
                              lr_scheduler=LRScheduler("LinearLR", {"start_factor": 0.5, "total_iters": 2}),
                              scaler=SCALER),
    "fsdp1_noshard_inf": _case("fsdp1", {"strategy": "NO_SHARD", "orig_params": True, "wrap": []},
                               clip=Clip("own", 0.1, "inf")),
    # float16 mixed precision with gradient accumulation: a scale of 2**24 overflows the float16 grads
    # (the reference replays the scaled casts: both skip), then backs off until the grads fit
    "fsdp2_mp_scaler": _case("fsdp2", {"wrap": [], "reshard_after_forward": True, "microbatches": 2,
                                       "mp": {"param_dtype": "float16", "reduce_dtype": "float16",
                                              "output_dtype": None, "cast_forward_inputs": True}},
                             scaler=Scaler(init_scale=2.0 ** 24, growth_interval=1), clip=Clip("norm", 0.1, "2")),
    # gradient accumulation: each microbatch's loss scaled, the unsynced grads summed scaled, a drawn overflow
    "fsdp2_microbatches": _case("fsdp2", {"wrap": ["layers.0"], "reshard_after_forward": False, "microbatches": 2},
                                scaler=SCALER, clip=Clip("value", 1e-3)),
    "zero_ddp": _case("zero", {"ddp": DDP}, clip=Clip("two_part", 0.1, "2"),
                      lr_scheduler=LRScheduler("LambdaLR", {"lambda": "linear_warmup", "warmup": 2}), scaler=SCALER),
    # fused SGD under ZeRO: GradScaler skips ZeRO's whole step on the overflow (ZeRO takes no found_inf), and
    # the reference's fused SGD is stepped the same way (Target.amp_scaling_step), not its kernel's skip
    "zero_fused_skip": dataclasses.replace(
        _case("zero", {}, scaler=dataclasses.replace(SCALER, overflow=(0,))),
        optim=Optim("SGD", {"lr": 0.01, "momentum": 0.9, "fused": True})),
    "zero_hand_value": _case("zero", {}, clip=Clip("value", 1e-3),
                             lr_scheduler=LRScheduler("ReduceLROnPlateau", {"mode": "min", "factor": 0.5,
                                                                            "patience": 0})),
    # a group added before step 2: its params are in no group at steps 0 and 1, so zero_grad leaves their clipped
    # grads in place and the next backward adds to them (the reference must start each step from the clipped grads)
    "zero_late_group_clip": dataclasses.replace(
        _case("zero", {}, clip=Clip("norm", 0.1, "2")),
        optim=Optim("Adam", {"lr": 0.01, "weight_decay": 0.1}, added_groups=1, added_at=2)),
    "sharded_optim": _case("sharded_optim", {"shard": {"layers.0.weight": {"dim": 0, "ranks": [1, 0]}}},
                           groups=(Group(NAMES),), lr_scheduler=LRScheduler("CosineAnnealingLR", {"T_max": 2}),
                           scaler=SCALER),
    # partial overflows (issue 45): every rank must skip the step that only some ranks' shards overflowed
    "fsdp2_partial": _case("fsdp2", {"wrap": ["layers.0"], "reshard_after_forward": True},
                           scaler=partial("layers.0.weight", 34), clip=Clip("norm", 0.1, "2")),
    "fsdp1_partial": _case("fsdp1", {"strategy": "FULL_SHARD", "orig_params": True, "wrap": []},
                           scaler=partial("layers.0.weight", 30)),
    "fsdp1_flat_partial": _case("fsdp1", {"strategy": "SHARD_GRAD_OP", "orig_params": False, "wrap": []},
                                groups=(Group(NAMES),), scaler=partial("layers.2.bias", 2, "nan")),
    "sharded_optim_partial": _case("sharded_optim", {"shard": {"layers.0.weight": {"dim": 0, "ranks": [1, 0]}}},
                                   groups=(Group(NAMES),), scaler=partial("layers.0.weight", 3, "-inf")),
    # a replicated grad (ZeRO's, all-reduced by DDP) overflows in every copy: a whole layer's
    "zero_partial_layer": _case("zero", {"ddp": DDP}, scaler=partial("layers.2.weight", layer=True)),
}

def _run(names, setup=None) -> dict:
    with Pool(2, options=PoolOptions(case_timeout=120, setup=[setup] if setup else ()), placed=True) as pool:
        return {n: pool.run(CASES[n]).verdict for n in names}

def test_each_targets_loop_features_pass_on_stock_torch():
    for case in CASES.values():
        case.check_world()
    verdicts = _run(list(CASES))
    bad = {n: (v.status, v.first or v.error) for n, v in verdicts.items() if v.status != "pass"}
    assert not bad, bad

def test_a_sharded_grad_scaler_that_steps_on_an_inf_is_caught():
    """Every target that pairs with ShardedGradScaler: the overflowing step applied, the reference skipped."""
    names = ["fsdp1_own", "fsdp2_mp_scaler", "sharded_optim"]
    verdicts = _run(names, setup=str(PLANTED / "loop_sharded_scaler_steps_on_inf.py"))
    for n in names:
        v = verdicts[n]
        assert v.is_finding and v.oracle == "parity", (n, v)
        assert v.first.quantity == "param" and "NaN in one run only" in v.first.detail, (n, v.first)

def test_a_sharded_grad_scaler_that_keeps_found_inf_per_rank_is_caught():
    """ShardedGradScaler's one addition over GradScaler, agreeing across ranks on found_inf, under a partial
    overflow: with found_inf kept per rank, the rank whose shard overflowed skips and the others step. The
    reference skips; every rank's found_inf is compared with it, first among what the step made, whichever rank
    the element is on (one face: rank 1 holds it in fsdp2's and sharded_optim's cases, rank 0 in fsdp1's). A
    whole-loss overflow (every rank) still passes."""
    names = ["fsdp2_partial", "fsdp1_partial", "fsdp1_flat_partial", "sharded_optim_partial", "fsdp2_microbatches"]
    verdicts = _run(names, setup=str(PLANTED / "loop_sharded_scaler_found_inf_unshared.py"))
    assert verdicts["fsdp2_microbatches"].status == "pass", verdicts["fsdp2_microbatches"]
    for n in names[:-1]:
        v = verdicts[n]
        assert v.is_finding and v.oracle == "parity" and v.first.step == 1, (n, v)
        assert v.first.quantity == "loop.found_inf" and v.first.extra["got"] == 0.0, (n, v.first)
        assert v.first.extra["at"] == ((1,) if n == "fsdp1_partial" else (0,)), (n, v.first)  # the rank that stepped


@pytest.mark.parametrize("target,options,loop,why", [
    ("zero", {"ddp": DDP, "uneven": [3, 1]}, {"scaler": SCALER}, "join hook steps without the loop"),
    ("zero", {"ddp": DDP, "uneven": [3, 1]}, {"lr_scheduler": LRScheduler("ExponentialLR", {"gamma": 0.9})},
     "join hook steps without the loop"),
])
def test_loop_features_a_target_cannot_run_are_refused_with_a_reason(target, options, loop, why):
    with pytest.raises(CaseError, match=why):
        _case(target, options, **loop).check_world()

def test_coverage_counts_the_loop_features():
    for name in ("fsdp1_own", "zero_ddp", "sharded_optim", "fsdp2_mp_scaler"):
        case = CASES[name]
        cells = set().union(*targets.get(case.target).spec.coverage(case).values())
        want = {f"clip {case.clip.how}"} if case.clip else set()
        want |= {f"lr {case.lr_scheduler.name}"} if case.lr_scheduler else set()
        want |= {"scaler overflow" if case.scaler.overflow else "scaler"} if case.scaler else set()
        assert want <= cells, (name, cells)
    assert targets.get("zero").spec.coverage(_case("zero", {})) == {}


def test_a_partial_overflow_is_left_out_of_the_json_when_none_and_round_trips():
    """Today's cases (no overflow_at) write the JSON they wrote before; one with it reads back the same."""
    plain = CASES["zero_ddp"]
    assert "overflow_at" not in plain.to_json() and Case.from_json(plain.to_json()) == plain
    case = CASES["fsdp1_partial"]
    data = case.to_dict()["scaler"]
    assert data["overflow_at"] == {"step": 1, "param": "layers.0.weight", "index": 30, "value": "inf", "layer": False}
    assert Case.from_json(case.to_json()) == case


@pytest.mark.parametrize("at,why", [
    (Overflow(3, "layers.0.weight"), "schedule has 3 steps"),
    (Overflow(0, "layers.1.weight"), "no such param"),
    (Overflow(0, "layers.2.bias", 3), "element 3 of layers.2.bias"),
    (Overflow(0, "layers.2.bias", 0, "big"), "inf, -inf or nan"),
])
def test_a_partial_overflow_the_case_cannot_hold_is_refused(at, why):
    case = _case("fsdp2", {"wrap": [], "reshard_after_forward": True},
                 scaler=dataclasses.replace(SCALER, overflow_at=at))
    with pytest.raises(CaseError, match=why):
        case.check_world()


def test_the_reference_sets_a_partial_overflow_in_the_full_grad_and_in_no_other_step():
    import math

    import torch

    from fuzzshard.kernel.loop import Loop

    case = CASES["fsdp1_partial"]
    loop = Loop(case, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not loop.overflows(1) and loop.partial(1) and not loop.partial(0)
    grads = {"layers.0.weight": torch.zeros(7, 5), "layers.0.bias": torch.zeros(7)}
    loop.inject_full(0, grads)
    assert all(float(g.abs().sum()) == 0 for g in grads.values())
    loop.inject_full(1, grads)
    w = grads["layers.0.weight"]
    assert w[6, 0] == math.inf and int(torch.isinf(w).sum()) == 1 and float(grads["layers.0.bias"].sum()) == 0
    layer = Loop(_case("zero", {}, scaler=partial("layers.0.bias", value="nan", layer=True)), loop.opt)
    assert bool(torch.isnan(layer.inject_full(1, grads)["layers.0.bias"]).all())


def test_partial_overflows_are_drawn_in_place_of_a_whole_loss_overflow_only():
    """Drawn only where the scaler draws an overflow step (that step then overflows in some grads only), so a
    case without an overflow draws as it did; each names a param of the model, an element of it, a step."""
    from hypothesis import HealthCheck, given, settings

    from fuzzshard.kernel.model import param_shapes
    from fuzzshard.strategies import cases

    seen = []

    @settings(max_examples=200, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(target="dtensor", world_sizes=(2,), loop=("scaler",), checkpoint=False))
    def draw(case):
        at = case.scaler and case.scaler.overflow_at
        if at:
            seen.append(at)
            assert at.step not in case.scaler.overflow and 0 <= at.step < len(case.schedule)
            assert at.index < max(1, math.prod(param_shapes(case.model)[at.param]))
            case.check_world()

    import math

    draw()
    assert seen and any(not at.layer for at in seen) and any(at.layer for at in seen), seen
