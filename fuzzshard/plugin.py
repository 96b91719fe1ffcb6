"""Bring your own optimizer, from one file: ``fuzzshard fuzz --plugin my_optim.py``.

    import hypothesis.strategies as st
    from fuzzshard import plugin

    class MyOptimizer(torch.optim.Optimizer): ...      # DTensor-aware, and fine on plain tensors

    plugin.optimizer(MyOptimizer, kwargs=st.fixed_dictionaries({
        "lr": st.sampled_from([1e-3, 1e-2]), "momentum": st.sampled_from([0.0, 0.9])}))

The file runs in the driver and in every worker (and in a repro script's
``--setup``), as ``--worker-setup`` does. Each case draws its optimizer from
torch.optim's and the plugin's; the reference runs the plugin's optimizer
unsharded on plain tensors, so it must take both (see examples/).
"""
from __future__ import annotations


def optimizer(cls, kwargs=None, name: str | None = None, elementwise: bool = True) -> type:
    """Register ``cls`` (a torch.optim.Optimizer subclass) under ``name``
    (default: the class name). ``kwargs``: a Hypothesis strategy of its
    hyperparameter dicts (default: none, the constructor's defaults).
    ``elementwise=False``: its step reduces over a whole param (an
    orthogonalization, a norm), so targets that step each shard on its own
    (fsdp1, sharded_optim) never draw it. Returns ``cls`` (a decorator too)."""
    from .kernel.optim import USER_OPTIMIZERS

    name = name or cls.__name__
    USER_OPTIMIZERS[name] = cls
    import importlib

    try:  # (the package's name `optimizers` is its strategy; the module holds the catalog)
        catalog = importlib.import_module("fuzzshard.strategies.optimizers")
    except ImportError:  # a repro script's world: nothing is drawn there
        return cls
    catalog.register(name, kwargs, elementwise)
    return cls
