"""Hypothesis strategies that draw fuzzshard Cases.

    from hypothesis import given
    import fuzzshard.strategies as fst

    @given(fst.cases(target="dtensor", world_sizes=[2, 3]))
    def test_my_property(fuzz_pool, case):
        ...

Draw order is shrink order: world size, depth, group count and step count
come first, so a shrunk case has few ranks, layers, groups and steps.
"""
from __future__ import annotations

import math

import hypothesis.strategies as st

from fuzzshard.case import Case, Checkpoint, Group, Optim, Step, mesh_shapes
from fuzzshard.kernel.model import param_shapes

from .models import models
from .optimizers import ONLY_2D, default_optimizers, group_overrides, optimizer_kwargs

__all__ = ["cases", "checkpoints", "models", "optimizers", "param_groups", "schedules", "placements",
           "TARGET_OPTIONS"]

DTYPES = ["float32", "float64"]


@st.composite
def optimizers(draw, names=None, device: str = "cpu") -> Optim:
    name = draw(st.sampled_from(names or default_optimizers()))
    kwargs = draw(optimizer_kwargs(name, device))
    tensor_lr = draw(st.sampled_from(["", "", "", "0d", "1d"]))
    return Optim(name=name, kwargs=kwargs, tensor_lr=tensor_lr, named=draw(st.booleans()))


@st.composite
def param_groups(draw, names: list[str], n_groups: int, optim: Optim) -> tuple[Group, ...]:
    """A shuffled split of ``names`` into ``n_groups`` groups (some may end up
    empty, which torch allows), each overriding a few hyperparameters."""
    order = draw(st.permutations(names)) if len(names) > 1 else list(names)
    owner = [draw(st.integers(0, n_groups - 1)) for _ in order]
    groups = []
    for g in range(n_groups):
        overrides = draw(group_overrides(optim.name)) if g else {}
        groups.append(Group(tuple(n for n, o in zip(order, owner) if o == g), overrides))
    return tuple(groups)


@st.composite
def schedules(draw, n_steps: int, names: list[str]) -> tuple[Step, ...]:
    """zero_grad(set_to_none) per step; now and then a param frozen or unfrozen mid-run."""
    steps = []
    for _ in range(n_steps):
        flip = draw(st.sampled_from(["", "", "", "freeze", "unfreeze"])) if names else ""
        target = (draw(st.sampled_from(names)),) if flip else ()
        steps.append(Step(set_to_none=draw(st.booleans()), freeze=target if flip == "freeze" else (),
                          unfreeze=target if flip == "unfreeze" else ()))
    return tuple(steps)


@st.composite
def placements(draw, shapes: dict, mesh_shape: tuple, tied: tuple = ()) -> dict:
    """dtensor: per param, per mesh dim, Replicate or Shard(d) on any of its dims."""
    out = {}
    for name, shape in shapes.items():
        choices = ["R"] + [f"S{d}" for d in range(len(shape))]
        out[name] = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    return {"placements": out}


@st.composite
def fsdp2_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = ()) -> dict:
    """fsdp2: which submodules get their own fully_shard (the root always does),
    and reshard_after_forward (True, False, or an int dividing the shard group).
    A module holding a tied param stays in the root's group, as FSDP2 documents
    (wrapping it alone is rejected with a clear error: an invalid config)."""
    owners = sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})
    wrap = [m for m in owners if m not in tied and draw(st.booleans())]
    shard = mesh_shape[-1]
    raf = draw(st.sampled_from([True, False] + [d for d in range(2, shard) if shard % d == 0]))
    out = {"wrap": wrap, "reshard_after_forward": raf}
    # extras, drawn off first so a shrunk case drops them
    if draw(st.booleans()):
        out["offload"] = True  # CPUOffloadPolicy(pin_memory=False)
    ac = [m for m in owners if draw(st.sampled_from([False, False, True]))]
    if ac:
        out["ac"] = ac  # composable activation checkpointing, applied before fully_shard
    microbatches = draw(st.sampled_from([1, 1, 2]))
    if microbatches > 1:
        out["microbatches"] = microbatches  # grad accumulation, no sync on all but the last
    return out


def _no_options(shapes, mesh_shape, tied=()):
    return st.just({})


# target -> (param shapes, mesh shape) -> strategy of its target_options
TARGET_OPTIONS = {"dtensor": placements, "fsdp2": fsdp2_options}
# targets where each rank trains on its slice of the global batch
DATA_PARALLEL = {"fsdp2"}
# targets whose state goes through torch.distributed.checkpoint's get_/set_state_dict
CHECKPOINTS = {"dtensor", "fsdp2"}
CHECKPOINT_KINDS = ["full", "dcp", "broadcast"]


@st.composite
def checkpoints(draw, target: str, world_sizes, n_steps: int, shapes: dict, tied: tuple = ()) -> Checkpoint:
    """A save point in the schedule, how the state is saved, and the loading
    side: any world size of the session (resharding), its own mesh and its
    own target options (another wrapping or placement)."""
    world = draw(st.sampled_from(sorted(world_sizes)))
    mesh_shape = draw(st.sampled_from(mesh_shapes(world)))
    return Checkpoint(
        after=draw(st.integers(0, n_steps - 1)),
        kind=draw(st.sampled_from(CHECKPOINT_KINDS)),
        world_size=world,
        mesh_shape=mesh_shape,
        target_options=draw(TARGET_OPTIONS.get(target, _no_options)(shapes, mesh_shape, tied)),
        split=draw(st.booleans()),
        strict=not draw(st.booleans()),
    )


@st.composite
def cases(
    draw,
    target: str = "dtensor",
    world_sizes=(1, 2, 3, 4),
    device: str = "cpu",
    max_depth: int = 4,
    max_groups: int = 3,
    max_steps: int = 3,
    optimizer_names=None,
    dtypes=DTYPES,
    checkpoint: bool | None = None,
) -> Case:
    """``checkpoint``: None draws a save/load round trip into some cases, True
    into every case, False into none (targets in CHECKPOINTS; add yours)."""
    world = draw(st.sampled_from(sorted(world_sizes)))
    depth = draw(st.integers(1, max_depth))
    n_groups = draw(st.integers(1, max_groups))
    n_steps = draw(st.integers(1, max_steps))
    mesh_shape = draw(st.sampled_from(mesh_shapes(world)))
    model = draw(models(depth))
    shapes = param_shapes(model)
    optim = draw(optimizers(optimizer_names, device))
    names = [n for n, s in shapes.items() if len(s) == 2] if optim.name in ONLY_2D else list(shapes)
    groups = draw(param_groups(names, n_groups, optim))
    frozen = tuple(n for n in shapes if draw(st.sampled_from([False] * 5 + [True])))
    tied = ("layers.0",) if model.tie_head else ()  # modules that own a tied param
    options = draw(TARGET_OPTIONS.get(target, _no_options)(shapes, mesh_shape, tied))
    ck = None
    if target in CHECKPOINTS and (checkpoint or (checkpoint is None and draw(st.booleans()))):
        ck = draw(checkpoints(target, world_sizes, n_steps, shapes, tied))
    # data parallel: every rank of either side gets an equal slice, in equal microbatches
    microbatches = max(options.get("microbatches", 1), ck.target_options.get("microbatches", 1) if ck else 1)
    ranks_per_sample = math.lcm(world, ck.world_size if ck else 1) * microbatches
    return Case(
        target=target,
        world_size=world,
        mesh_shape=mesh_shape,
        model=model,
        optim=optim,
        groups=groups,
        schedule=draw(schedules(n_steps, list(shapes))),
        frozen=frozen,
        batch=draw(st.integers(1, 2)) * ranks_per_sample if target in DATA_PARALLEL else draw(st.integers(1, 4)),
        seq=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(list(dtypes))),
        device=device,
        target_options=options,
        seed=draw(st.integers(0, 2**16 - 1)),
        checkpoint=ck,
    )
