"""Hand-written cases for tests that need an exact configuration."""
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step


def simple_case(world=2, optim="SGD", lr=0.01, placements=None, **kwargs):
    model = Model("features", 5, (Layer("linear", 5, 7), Layer("act", act="tanh"), Layer("linear", 7, 3)))
    names = ("layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias")
    return Case(
        target="dtensor", world_size=world, mesh_shape=(world,), model=model,
        optim=Optim(optim, {"lr": lr, "weight_decay": 0.1, **kwargs}),
        groups=(Group(names[:2]), Group(names[2:], {"lr": lr * 2})),
        schedule=(Step(), Step(set_to_none=False)), batch=3, seq=2,
        target_options={"placements": placements or {"layers.0.weight": ["S0"], "layers.2.weight": ["S1"]}},
    )
