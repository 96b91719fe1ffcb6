"""Hand-written cases with a tied weight (tests/test_tied.py): a topology whose head shares the embedding's
weight, and the decoder with ``tied``, for each target that shards a tie."""
import dataclasses

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step


def tied_topology(vocab=5, dim=3) -> Model:
    """Embedding(vocab, dim) -> Linear(dim, dim) -> tanh -> Linear(dim, dim) -> head (the embedding's weight)."""
    return Model("tokens", vocab, (Layer("embedding", vocab, dim), Layer("linear", dim, dim),
                                   Layer("act", act="tanh"), Layer("linear", dim, dim, bias=False)), tie_head=True)


def tied_decoder(vocab=5, n_layers=1) -> Model:
    sizes = {"d_in": vocab, "n_layers": n_layers, "n_heads": 2, "n_kv_heads": 2, "head_dim": 2, "hidden": 4,
             "mlp": "swiglu", "norm": "rms", "causal": True, "tied": True}
    return Model("tokens", vocab, (), factory="decoder", sizes=sizes)


def tied_case(target: str, world: int, model: Model, options: dict, mesh=None, optim="Adam", steps=2,
              batch=4, seq=3) -> Case:
    from fuzzshard.kernel.model import param_shapes

    names = tuple(param_shapes(model))
    return Case(target=target, world_size=world, mesh_shape=tuple(mesh or (world,)), model=model,
                optim=Optim(optim, {"lr": 0.05}), groups=(Group(names),), schedule=(Step(),) * steps,
                batch=batch, seq=seq, target_options=options)


def replace(case: Case, **kw) -> Case:
    return dataclasses.replace(case, **kw)
