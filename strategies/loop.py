"""The training loop around the step (kernel/loop.py), drawn: gradient
clipping, an LR scheduler, a grad scaler. Each is drawn after the rest of
the case, only where the target says it takes it (its Spec's ``clips``,
``lr_scheduler``, ``scaler``) and the session asks for it (``cases(loop=...)``),
and each shrinks to "not used" (``st.none()`` first), so a shrunk case holds
no more of the loop than its bug needs.
"""
from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st

from fuzzshard.case import Clip, LRScheduler, Overflow, Scaler

FEATURES = ("clip", "lr_scheduler", "scaler", "async_save")  # async_save: checkpoints() draws it

# the schedulers people step every step (torchtitan: LambdaLR's warmup; Lightning and recipes: the rest)
SCHEDULERS = ("LambdaLR", "StepLR", "MultiStepLR", "LinearLR", "CosineAnnealingLR", "OneCycleLR",
              "SequentialLR", "ReduceLROnPlateau", "ExponentialLR", "ConstantLR", "PolynomialLR",
              "CosineAnnealingWarmRestarts", "CyclicLR", "ChainedScheduler")


@st.composite
def clips(draw, forms: tuple, steered=None) -> Clip | None:
    """clip_grad_norm_ (every norm type, foreach on and off, error_if_nonfinite), torchtitan's two-part
    form, clip_grad_value_ and a target's own (FSDP1's): small max norms, so clipping bites."""
    if not forms or not draw(st.booleans()):
        return None
    how = draw(st.sampled_from(list(steered or forms)))  # steered: a timed session's weighted forms
    return Clip(how=how, max_norm=draw(st.sampled_from([1.0, 0.1, 1e-3, 10.0])),
                norm_type=draw(st.sampled_from(["2", "1", "inf", "3"])) if how != "value" else "2",
                foreach=draw(st.sampled_from([None, True, False])) if how != "own" else None,
                error_if_nonfinite=draw(st.booleans()) if how in ("norm", "two_part") else False)


def _one(draw, name: str, n_steps: int) -> LRScheduler:
    n = max(n_steps, 1)
    kwargs = {
        "LambdaLR": lambda: ({"lambda": "linear_warmup", "warmup": draw(st.integers(0, n))} if draw(st.booleans())
                             else {"lambda": "exponential", "factor": draw(st.sampled_from([0.9, 0.5]))}),
        "StepLR": lambda: {"step_size": draw(st.integers(1, n)), "gamma": draw(st.sampled_from([0.1, 0.5]))},
        "MultiStepLR": lambda: {"milestones": sorted(set(draw(st.lists(st.integers(1, n), min_size=1, max_size=3)))),
                                "gamma": draw(st.sampled_from([0.1, 0.5]))},
        "LinearLR": lambda: {"start_factor": draw(st.sampled_from([1 / 3, 0.5, 0.1])),
                             "end_factor": draw(st.sampled_from([1.0, 0.5])), "total_iters": draw(st.integers(1, n))},
        "CosineAnnealingLR": lambda: {"T_max": draw(st.integers(1, n)), "eta_min": draw(st.sampled_from([0.0, 1e-4]))},
        "OneCycleLR": lambda: {"max_lr": draw(st.sampled_from([0.1, 0.01])), "total_steps": n + 1,
                               "pct_start": draw(st.sampled_from([0.3, 0.5])),
                               "anneal_strategy": draw(st.sampled_from(["cos", "linear"])),
                               "cycle_momentum": False},
        "ReduceLROnPlateau": lambda: {"mode": "min", "factor": draw(st.sampled_from([0.1, 0.5])),
                                      "patience": draw(st.integers(0, 1)), "threshold": 1e-4},
        "ExponentialLR": lambda: {"gamma": draw(st.sampled_from([0.9, 0.5]))},
        "ConstantLR": lambda: {"factor": draw(st.sampled_from([1 / 3, 0.5])), "total_iters": draw(st.integers(1, n))},
        "PolynomialLR": lambda: {"total_iters": draw(st.integers(1, n)), "power": draw(st.sampled_from([1.0, 2.0]))},
        "CosineAnnealingWarmRestarts": lambda: {"T_0": draw(st.integers(1, n)), "T_mult": draw(st.integers(1, 2))},
        "CyclicLR": lambda: {"base_lr": 1e-3, "max_lr": 0.1, "step_size_up": draw(st.integers(1, n)),
                             "cycle_momentum": False},
    }
    if name in ("SequentialLR", "ChainedScheduler"):
        simple = ["LinearLR", "ConstantLR", "ExponentialLR", "StepLR", "CosineAnnealingLR"]
        children = tuple(_one(draw, draw(st.sampled_from(simple)), n_steps) for _ in range(2))
        extra = {"milestones": [draw(st.integers(1, n))]} if name == "SequentialLR" else {}
        return LRScheduler(name, extra, children)
    return LRScheduler(name, kwargs[name]())


@st.composite
def lr_schedulers(draw, n_steps: int, steered=None) -> LRScheduler | None:
    if not draw(st.booleans()):
        return None
    return _one(draw, draw(st.sampled_from(list(steered or SCHEDULERS))), n_steps)


@st.composite
def scalers(draw, n_steps: int, amp_too: bool = False, shapes: dict | None = None) -> Scaler | None:
    """Powers of two throughout (as the defaults are), so scaling and unscaling are exact; now and then a
    step whose loss overflows on purpose, and a growth interval short enough for the scale to grow.
    Where a case overflows, now and then its first overflow step overflows where real training does
    instead (``overflow_at``, drawn last, so every other draw stays where it was): a non-finite value
    in one element of one param's grad (``shapes``: the model's params), seen only by the ranks
    that hold that element, or in every element of one param's grad (a float16 layer that overflows).
    It shrinks to the whole-loss overflow (None first), then to the first param, element 0, inf."""
    if not draw(st.booleans()):
        return None
    overflow = tuple(k for k in range(n_steps) if draw(st.sampled_from([False, False, True])))
    scaler = Scaler(init_scale=2.0 ** draw(st.sampled_from([16, 0, 8, 24])),
                    growth_factor=draw(st.sampled_from([2.0, 4.0])), backoff_factor=draw(st.sampled_from([0.5, 0.25])),
                    growth_interval=draw(st.sampled_from([2000, 1, 2])), overflow=overflow,
                    amp=amp_too and draw(st.booleans()))  # (the target's own scaler first: where a shrunk case goes)
    if overflow and shapes and draw(st.integers(0, 3)):  # 3 in 4 (0, a whole-loss overflow, first)
        k = draw(st.sampled_from(overflow))
        param = draw(st.sampled_from(sorted(shapes)))
        numel = max(math.prod(shapes[param]), 1)
        at = Overflow(step=k, param=param, index=draw(st.integers(0, numel - 1)),
                      value=draw(st.sampled_from(["inf", "nan", "-inf"])),
                      layer=draw(st.sampled_from([False, False, True])))
        scaler = dataclasses.replace(scaler, overflow=tuple(j for j in overflow if j != k), overflow_at=at)
    return scaler


@st.composite
def loop_features(draw, spec, case, features, steer: dict | None = None) -> dict:
    """The Case fields of the loop features asked for that the target takes. ``steer``: a timed session's
    weighted choices (session/schedule.py): the clip forms and scheduler classes covered least come most."""
    steer = steer or {}
    out = {}
    if "clip" in features and spec.clips:
        out["clip"] = draw(clips(spec.clips, steer.get("clip")))
    if "lr_scheduler" in features and spec.lr_scheduler and (spec.lr_scheduler_checkpoint or not case.checkpoint):
        out["lr_scheduler"] = draw(lr_schedulers(len(case.schedule), steer.get("lr_scheduler")))
    if "scaler" in features and spec.scaler and not case.optim.added_at:  # (Case.check_world says why)
        from fuzzshard.kernel.model import param_shapes

        shapes = {n: s for n, s in param_shapes(case.model).items() if not n.startswith("unused.")}  # (no grads)
        out["scaler"] = draw(scalers(len(case.schedule), spec.amp_scaler, shapes))
    return out
