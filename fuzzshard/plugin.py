"""Bring your own optimizer, model or parallelism, from one file:
``fuzzshard fuzz --plugin my_file.py``.

    import hypothesis.strategies as st
    from fuzzshard import plugin

    class MyOptimizer(torch.optim.Optimizer): ...      # DTensor-aware, and fine on plain tensors

    plugin.optimizer(MyOptimizer, kwargs=st.fixed_dictionaries({
        "lr": st.sampled_from([1e-3, 1e-2]), "momentum": st.sampled_from([0.0, 0.9])}))

    plugin.model(build_my_model, sizes=st.fixed_dictionaries({"d_in": st.integers(2, 8), ...}))
    plugin.parallelism(my_parallelize, options=st.fixed_dictionaries({"tp": st.booleans()}))

The file runs in the driver and in every worker (and in a repro script's
``--setup``), as ``--worker-setup`` does. Each case draws its optimizer from
torch.optim's and the plugin's, its model from the random topologies and the
plugin's; a parallelism is a target of its own (``--target NAME``). The
reference runs the same optimizer and model unsharded on plain tensors, so
an optimizer must take both (see examples/).
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


def model(build, sizes, name: str | None = None, tokens: bool = False):
    """Register a model factory: ``build(**sizes)`` returns a real
    ``nn.Module``, built under a seeded RNG (so every rank and the reference
    build the same one). ``sizes``: a Hypothesis strategy of dicts holding at
    least ``d_in``: the input width, or the vocabulary when ``tokens`` (the
    model then takes [B, L] token ids; else [B, L, d_in] floats). It returns
    [B, L, d_out]; the loss is the mean squared error against drawn targets.
    Draw small sizes that shrink towards 1 (``st.integers(1, 8)``). Returns
    ``build``."""
    from .kernel.model import USER_MODELS

    name = name or build.__name__
    USER_MODELS[name] = build
    import importlib

    try:  # (the package's name `models` is its strategy; the module holds the catalog)
        catalog = importlib.import_module("fuzzshard.strategies.models")
    except ImportError:  # a repro script's world
        return build
    catalog.register(name, sizes, tokens)
    return build


def parallelism(parallelize, options=None, name: str | None = None, models=(), dp_dims=None,
                checkpoints: bool = True):
    """Register ``parallelize(model, mesh, options)`` as the target ``name``
    (default: the function's name), fuzzed with ``--target NAME`` against the
    unsharded model. ``mesh``: the case's DeviceMesh (1-D, or 2-D with dims
    "d0" and "d1"). ``options``: a strategy of its options dicts, or a
    function ``(mesh_shape, model)`` that returns one (``model``: the case's
    ``Model``, a plugin model's drawn ``sizes`` in it), so that TP is drawn
    only on a 2-D mesh and where the head count divides, say.
    ``models``: the plugin models it is written for (module names its plan
    uses); only those are drawn (default: any model). ``dp_dims(ndim,
    options)``: the mesh dims the batch is split over (default: every dim,
    or dim 0 alone when ``options["tp"]`` is set). ``checkpoints``: also
    draw DCP / state-dict round trips. Returns ``parallelize``."""
    from .kernel.targets.parallelize import USER_PARALLELISMS, ParallelizeTarget

    name = name or parallelize.__name__
    USER_PARALLELISMS[name] = (parallelize, dp_dims)
    from . import targets
    from .kernel.state_io import STATE_DICT_KINDS
    from .kernel.targets.base import Spec

    def draw_options(draw, shapes, mesh_shape, tied=(), **context):
        from hypothesis.strategies import SearchStrategy

        if options is None:
            return {}
        strategy = options if isinstance(options, SearchStrategy) else options(tuple(mesh_shape), context.get("model"))
        return dict(draw(strategy))

    spec = Spec(options=draw_options, checkpoint_kinds=STATE_DICT_KINDS if checkpoints else {}, data_parallel=True,
                named_params=True, models=tuple(models))
    targets.register_target(name, type(f"Parallelize[{name}]", (ParallelizeTarget,), {"name": name}), spec=spec)
    return parallelize
