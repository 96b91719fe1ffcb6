"""Optimizers of torch.optim with every constructor flag, over realistic ranges.

Each entry maps a class name to a function ``draw -> kwargs``. Values are
JSON-native (lists, not tuples). Configs torch rejects (nesterov without
momentum, a tensor lr with foreach, ...) are drawn on purpose now and then:
the reference rejects them and the case is discarded as invalid.
"""
from __future__ import annotations

import inspect

import hypothesis.strategies as st
import torch

LRS = [1e-3, 1e-2, 1e-1, 3e-4, 0.5]
WEIGHT_DECAYS = [0.0, 0.01, 0.1, 0.5]
EPS = [1e-8, 1e-6, 1e-3]


def _betas(draw) -> list:
    return [draw(st.sampled_from([0.9, 0.0, 0.5, 0.99])), draw(st.sampled_from([0.999, 0.9, 0.99, 0.9999]))]


def _lr(draw, choices=LRS) -> float:
    return draw(st.sampled_from(choices))


def _adam(draw, name):
    kw = {"lr": _lr(draw), "betas": _betas(draw), "eps": draw(st.sampled_from(EPS)),
          "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)), "amsgrad": draw(st.booleans())}
    if name == "Adam":
        kw["decoupled_weight_decay"] = draw(st.booleans())
    return kw


def _sgd(draw, name):
    momentum = draw(st.sampled_from([0.0, 0.9, 0.5]))
    return {"lr": _lr(draw), "momentum": momentum, "dampening": draw(st.sampled_from([0.0, 0.1])),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)), "nesterov": draw(st.booleans()) if momentum else False}


def _adagrad(draw, name):
    return {"lr": _lr(draw), "lr_decay": draw(st.sampled_from([0.0, 0.01])),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)),
            "initial_accumulator_value": draw(st.sampled_from([0.0, 0.1])), "eps": draw(st.sampled_from([1e-10, 1e-6]))}


def _rmsprop(draw, name):
    return {"lr": _lr(draw), "alpha": draw(st.sampled_from([0.99, 0.9])), "eps": draw(st.sampled_from(EPS)),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)), "momentum": draw(st.sampled_from([0.0, 0.9])),
            "centered": draw(st.booleans())}


def _adadelta(draw, name):
    return {"lr": _lr(draw, [1.0, 0.1, 0.5]), "rho": draw(st.sampled_from([0.9, 0.5])),
            "eps": draw(st.sampled_from([1e-6, 1e-3])), "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS))}


def _nadam(draw, name):
    return {"lr": _lr(draw), "betas": _betas(draw), "eps": draw(st.sampled_from(EPS)),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)), "momentum_decay": draw(st.sampled_from([0.004, 0.05])),
            "decoupled_weight_decay": draw(st.booleans())}


def _radam(draw, name):
    return {"lr": _lr(draw), "betas": _betas(draw), "eps": draw(st.sampled_from(EPS)),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS)), "decoupled_weight_decay": draw(st.booleans())}


def _adamax(draw, name):
    return {"lr": _lr(draw), "betas": _betas(draw), "eps": draw(st.sampled_from(EPS)),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS))}


def _asgd(draw, name):
    # t0=1 starts the averaging (ax, mu) within the few steps a case runs
    return {"lr": _lr(draw), "lambd": draw(st.sampled_from([1e-4, 1e-2])), "alpha": draw(st.sampled_from([0.75, 0.5])),
            "t0": draw(st.sampled_from([1e6, 1.0])), "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS))}


def _rprop(draw, name):
    return {"lr": _lr(draw), "etas": draw(st.sampled_from([[0.5, 1.2], [0.3, 1.5]])),
            "step_sizes": draw(st.sampled_from([[1e-6, 50.0], [1e-3, 1.0]]))}


def _adafactor(draw, name):
    return {"lr": _lr(draw), "beta2_decay": draw(st.sampled_from([-0.8, -0.5])),
            "eps": [None, draw(st.sampled_from([1e-3, 1e-2]))], "d": draw(st.sampled_from([1.0, 2.0])),
            "weight_decay": draw(st.sampled_from(WEIGHT_DECAYS))}


def _muon(draw, name):
    return {"lr": _lr(draw), "weight_decay": draw(st.sampled_from([0.1, 0.0, 0.01])),
            "momentum": draw(st.sampled_from([0.95, 0.5])), "nesterov": draw(st.booleans()),
            "ns_steps": draw(st.integers(1, 5)),
            "adjust_lr_fn": draw(st.sampled_from([None, "original", "match_rms_adamw"]))}


CATALOG = {
    "Adam": _adam, "AdamW": _adam, "SGD": _sgd, "Adagrad": _adagrad, "RMSprop": _rmsprop,
    "Adadelta": _adadelta, "NAdam": _nadam, "RAdam": _radam, "Adamax": _adamax, "ASGD": _asgd,
    "Rprop": _rprop, "Adafactor": _adafactor, "Muon": _muon,
}
# Optimizers that only take 2-D params; their groups hold only those.
ONLY_2D = {"Muon"}
# optimizers that reduce over a whole param (Adafactor's row/column means, Muon's orthogonalization):
# stepping each shard on its own is other math
NOT_ELEMENTWISE = {"Adafactor", "Muon"}
# Not for dense per-step training: LBFGS needs a closure, SparseAdam sparse grads.
EXCLUDED = {"LBFGS", "SparseAdam"}


# Drawn only when asked for by name: Muon's Newton-Schulz runs in bfloat16 and
# amplifies rounding by design, so an elementwise oracle can only catch gross bugs.
OPT_IN = {"Muon"}


def available() -> list[str]:
    """The catalog's optimizers present in this torch, first the classics (they
    shrink first); a plugin's come last."""
    from fuzzshard.kernel.optim import USER_OPTIMIZERS

    return [n for n in CATALOG if hasattr(torch.optim, n) or n in USER_OPTIMIZERS]


def register(name: str, kwargs=None, elementwise: bool = True) -> None:
    """A plugin's optimizer, drawn beside torch.optim's: ``kwargs`` a strategy
    of its hyperparameters (dicts); ``elementwise=False`` keeps it off targets
    that step each shard on its own (it reduces over a whole param)."""
    CATALOG[name] = (lambda draw, _: dict(draw(kwargs))) if kwargs is not None else (lambda draw, _: {})
    if not elementwise:
        NOT_ELEMENTWISE.add(name)


def implementations(name: str) -> list[str]:
    return ["foreach", "forloop"] + (["fused"] if accepts(name, "fused") else [])


def default_optimizers() -> list[str]:
    return [n for n in available() if n not in OPT_IN]


def unknown_optimizers() -> list[str]:
    """torch.optim classes this catalog does not know yet (a newer torch)."""
    base = torch.optim.Optimizer
    found = [n for n, c in vars(torch.optim).items() if inspect.isclass(c) and issubclass(c, base) and c is not base]
    return sorted(set(found) - set(CATALOG) - EXCLUDED)


def accepts(name: str, kwarg: str) -> bool:
    from fuzzshard.kernel.optim import optimizer_class

    return kwarg in inspect.signature(optimizer_class(name).__init__).parameters


@st.composite
def optimizer_kwargs(draw, name: str, device: str = "cpu", implementation: str | None = None) -> dict:
    """Hyperparameters plus the implementation flags (for-loop / foreach / fused);
    ``implementation``: that one only (a session's round that pins it)."""
    kw = CATALOG[name](draw, name)
    if accepts(name, "maximize"):
        kw["maximize"] = draw(st.booleans())
    impls = implementations(name)
    impl = draw(st.sampled_from([implementation] if implementation in impls else impls))
    if accepts(name, "foreach"):
        kw["foreach"] = impl == "foreach"
    if impl == "fused":
        kw["fused"] = True
    if device == "cuda" and accepts(name, "capturable") and impl != "fused":
        kw["capturable"] = draw(st.booleans())
    return kw


# Hyperparameters a param group may override, by optimizer.
def group_overrides(name: str):
    @st.composite
    def draw_overrides(draw) -> dict:
        from fuzzshard.kernel.lowbit import LOWBIT_OPTIMIZERS

        base = "AdamW" if name in LOWBIT_OPTIMIZERS else name  # torchao's low-bit AdamW (--ao): AdamW's own
        full = CATALOG[base](draw, base)
        keys = sorted(k for k in full if k in ("lr", "weight_decay", "betas", "momentum", "eps", "alpha", "lambd"))
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=3)) if keys else []
        return {k: full[k] for k in sorted(chosen)}

    return draw_overrides()
