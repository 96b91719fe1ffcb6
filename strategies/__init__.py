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

import dataclasses
import math

import hypothesis.strategies as st
from hypothesis import assume

from fuzzshard.case import Case, Checkpoint, Group, Optim, Step, mesh_shapes
from fuzzshard.kernel.model import param_shapes

from .models import models
from .optimizers import ONLY_2D, default_optimizers, group_overrides, optimizer_kwargs

__all__ = ["cases", "checkpoints", "models", "optimizers", "param_groups", "schedules", "placements",
           "TARGET_OPTIONS"]

DTYPES = ["float32", "float64"]


def _without_local_constants() -> None:
    """Hypothesis mixes the literals of every "local" module (one outside
    site-packages: fuzzshard itself when installed editable, a user's project)
    into what it draws, now and then. So a seeded draw changed with any edit
    of that code, or with what else the process had imported: the planted
    tests' seeds moved with unrelated changes, and a session's --seed meant
    other cases in a pytest process than under the CLI. The code under test
    is torch, not those modules: fuzzshard draws without them."""
    try:
        from hypothesis.internal.conjecture import providers

        empty = providers.Constants()
        providers._get_local_constants = lambda: empty
        providers.CONSTANTS_CACHE.cache.clear()
    except (ImportError, AttributeError):  # another Hypothesis: its draws are its own
        pass


_without_local_constants()


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
def placements(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **_) -> dict:
    """dtensor: per param, per mesh dim, Replicate or Shard(d) on any of its dims."""
    out = {}
    for name, shape in shapes.items():
        choices = ["R"] + [f"S{d}" for d in range(len(shape))]
        out[name] = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    return {"placements": out}


@st.composite
def fsdp2_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """fsdp2: which submodules get their own fully_shard (the root always does),
    and reshard_after_forward (True, False, or an int dividing the shard group).
    A module holding a tied param stays in the root's group, as FSDP2 documents
    (wrapping it alone is rejected with a clear error: an invalid config)."""
    owners = sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})
    # on a 2-D mesh: HSDP (replicate x shard), or TP on the inner dim + FSDP2 on the outer
    tp = draw(tp_plans(shapes, tied, context["model"])) if len(mesh_shape) == 2 and draw(st.booleans()) else {}
    wrap = [m for m in owners if m not in tied and draw(st.booleans())]
    shard = mesh_shape[0] if tp else mesh_shape[-1]
    raf = draw(st.sampled_from([True, False] + [d for d in range(2, shard) if shard % d == 0]))
    out = {"wrap": wrap, "reshard_after_forward": raf}
    if tp:
        out["tp"] = tp
    # extras, drawn off first so a shrunk case drops them
    if draw(st.booleans()):
        out["offload"] = True  # CPUOffloadPolicy(pin_memory=False)
    ac = [m for m in owners if draw(st.sampled_from([False, False, True]))]
    if ac:
        out["ac"] = ac  # activation checkpointing, applied before fully_shard: composable
        if draw(st.booleans()):
            out["ac_wrapper"] = True  # or apply_activation_checkpointing's CheckpointWrapper
    microbatches = draw(st.sampled_from([1, 1, 2]))
    if microbatches > 1:
        out["microbatches"] = microbatches  # grad accumulation, no sync on all but the last
    if not tp and draw(st.sampled_from([False, False, True])):
        # (not with TP: its low-precision partial sums are not replayed yet)
        out["mp"] = draw(mp_policies())
    return out


@st.composite
def tp_plans(draw, shapes: dict, tied: tuple, model) -> dict:
    """A TP style per Linear (colwise or rowwise, or none) and for the input
    Embedding (colwise or none; row-wise Embedding sharding is the dtensor
    target's); a module holding a tied param keeps it whole."""
    plan = {}
    for name, shape in shapes.items():
        fqn = name.rsplit(".", 1)[0]
        if not name.endswith(".weight") or len(shape) != 2 or fqn in tied:
            continue
        embedding = fqn == "layers.0" and model.input == "tokens"
        style = draw(st.sampled_from([None, "colwise"] if embedding else [None, "colwise", "rowwise"]))
        if style:
            plan[fqn] = style
    return plan


@st.composite
def mp_policies(draw) -> dict:
    """fsdp2's MixedPrecisionPolicy, one for every unit: compute (param) dtype,
    reduce dtype, output dtype and cast_forward_inputs."""
    return {"param_dtype": draw(st.sampled_from([None, "bfloat16", "float16"])),
            "reduce_dtype": draw(st.sampled_from([None, "float32", "bfloat16", "float16"])),
            "output_dtype": draw(st.sampled_from([None, "float32"])),
            # off, float inputs meet low-precision params: a dtype error on both sides (invalid)
            "cast_forward_inputs": draw(st.sampled_from([True, True, True, False]))}


@st.composite
def fsdp1_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), flat: bool = False, loading: bool = False,
                  kind: str = "", **_) -> dict:
    """fsdp1: the sharding strategy (hybrid ones on a 2-D mesh), use_orig_params
    (off only in a ``flat`` case: one group, elementwise, nothing frozen, where
    the flat params can stand in for the originals), the submodules wrapped in
    their own unit (a module holding a tied param stays in its parent's unit,
    as with fsdp2), and for the fsdp1_* checkpoint kinds the state-dict
    config on the saving side and the legacy load API on the loading side."""
    if len(mesh_shape) == 2:
        strategy = draw(st.sampled_from(["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]))
    else:
        strategy = draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]))
    owners = sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})
    out = {"strategy": strategy, "orig_params": not flat or draw(st.booleans()),
           "wrap": [m for m in owners if m not in tied and draw(st.booleans())]}
    if kind.startswith("fsdp1_") and not loading:
        out["osd"] = {"offload_to_cpu": draw(st.booleans()), "rank0_only": draw(st.booleans())}
    if kind == "fsdp1_legacy" and loading:
        out["legacy_load"] = draw(st.sampled_from(["shard", "scatter"]))
    # extras, drawn last so the draws above keep their order: modules FSDP ignores
    # (not wrapped, not above a wrapped one) and, on a full kind's loading side,
    # resuming without FSDP through rekey_optim_state_dict
    free = [m for m in owners if m not in tied and not any(w == m or w.startswith(m + ".") for w in out["wrap"])]
    ignored = [m for m in free if draw(st.integers(0, 3)) == 3]  # a shrunk case ignores nothing
    if ignored:
        out["ignored"] = ignored
    if loading and kind in ("fsdp1_full", "fsdp1_legacy") and draw(st.integers(0, 3)) == 3:
        out["local"] = True
    if kind == "fsdp1_sharded" and draw(st.booleans()):  # the legacy sharded APIs
        out["flatten" if loading else "legacy"] = True
    return out


@st.composite
def zero_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), model=None, loading: bool = False,
                 **_) -> dict:
    """zero: grads averaged by hand or by DDP (with its flags), the bucket
    view, the rank the state is consolidated to; a loading side may resume
    with the local optimizer."""
    out = {}
    if draw(st.booleans()):
        # an unused submodule needs find_unused_parameters (DDP documents the error otherwise)
        out["ddp"] = {"broadcast_buffers": draw(st.booleans()),
                      "find_unused_parameters": True if model is not None and model.unused else draw(st.booleans()),
                      "gradient_as_bucket_view": draw(st.booleans()), "static_graph": draw(st.booleans())}
    if loading and draw(st.booleans()):
        out["local"] = True
        return out
    out["bucket_view"] = draw(st.booleans())
    to = draw(st.integers(0, mesh_shape[0] - 1))
    if to:
        out["consolidate_to"] = to
    return out


@st.composite
def sharded_optim_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **_) -> dict:
    """sharded_optim: which params become ShardedTensors, on which dim, and
    the ranks that hold the chunks, in chunk order: mostly one chunk per rank
    in any order (ChunkShardingSpec.shard scatters one chunk to each rank),
    now and then any list (a rank with two chunks or none: known errors).
    A tied param stays dense: shard_parameter re-registers it on one module only."""
    world = mesh_shape[0]
    out = {}
    for name, shape in shapes.items():
        if not shape or any(name.startswith(t + ".") for t in tied) or not draw(st.booleans()):
            continue
        if draw(st.integers(0, 7)):
            ranks = draw(st.permutations(range(world)))
        else:
            ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world + 1))
        out[name] = {"dim": draw(st.integers(0, len(shape) - 1)), "ranks": ranks}
    return {"shard": out}


def _no_options(shapes, mesh_shape, tied=(), **_):
    return st.just({})


# target -> (param shapes, mesh shape, tied, **context) -> strategy of its target_options
TARGET_OPTIONS = {"dtensor": placements, "fsdp2": fsdp2_options, "fsdp1": fsdp1_options, "zero": zero_options,
                  "sharded_optim": sharded_optim_options}
# targets that train on uneven inputs under torch.distributed.algorithms.Join
JOIN = {"zero"}
# targets where each rank trains on its slice of the global batch
DATA_PARALLEL = {"fsdp2", "fsdp1", "zero"}
# targets with a checkpoint round trip, and how each saves
CHECKPOINT_KINDS = {"dtensor": ["full", "dcp", "broadcast"], "fsdp2": ["full", "dcp", "broadcast"],
                    "fsdp1": ["full", "dcp", "broadcast", "fsdp1_full", "fsdp1_sharded", "fsdp1_legacy"],
                    "zero": ["consolidate"]}
CHECKPOINTS = set(CHECKPOINT_KINDS)
# targets whose optimizer takes (name, param) pairs (torch.optim's named-params API)
NAMED_PARAMS = {"dtensor", "fsdp2"}
# targets whose optimizer takes one flat set of params (no param groups)
SINGLE_GROUP = {"sharded_optim"}
# targets that step each shard on its own: only elementwise optimizers give the
# same math as the whole param (Adafactor and Muon reduce over a whole param;
# FSDP1 steps each rank's flat 1-D slice of a param)
ELEMENTWISE_ONLY = {"sharded_optim", "fsdp1"}
NOT_ELEMENTWISE = {"Adafactor", "Muon"}
# kinds that go through torch.distributed.checkpoint's set_state_dict (split / strict apply)
STATE_DICT_KINDS = {"full", "dcp", "broadcast"}


# targets whose cases also give param groups through add_param_group after the
# constructor (dtensor and fsdp2 next: their DSD load path needs a look first)
ADD_PARAM_GROUP = {"zero"}
# targets whose cases now and then build the model in another dtype and call
# model.to(case dtype) after sharding it (exact: float32 <-> float64 round-trips)
TO_DTYPE = {"fsdp2"}
# targets whose cases now and then call a wrapped layers.0 from outside the root's forward
NONROOT = {"fsdp2"}
# targets whose cases now and then give each group's params as a one-shot iterator
GENERATOR_GROUPS = {"zero"}
# targets on one flat process group: a 1-D mesh only
FLAT = {"zero", "sharded_optim"}
# targets whose wrapper records requires_grad when it wraps: no freeze or unfreeze mid-run
FLAGS_FIXED_AT_WRAP = {"fsdp1"}
# targets that may flatten params (FSDP1 without use_orig_params): whether a case
# lets them is drawn first, and such a case keeps to what flat params can mirror
MAY_FLATTEN = {"fsdp1"}


def _meshes(target: str, world: int) -> list[tuple[int, ...]]:
    return [(world,)] if target in FLAT else mesh_shapes(world)


def _flips_allowed(target: str, options: dict, ck) -> bool:
    """DDP and FSDP1 record the params that require grad when they wrap;
    flipping requires_grad later is outside what they support."""
    return target not in FLAGS_FIXED_AT_WRAP and "ddp" not in options and not (ck and "ddp" in ck.target_options)


@st.composite
def checkpoints(draw, target: str, world_sizes, n_steps: int, shapes: dict, tied: tuple = (), **context) -> Checkpoint:
    """A save point in the schedule, how the state is saved, and the loading
    side: any world size of the session (resharding), its own mesh and its
    own target options (another wrapping or placement)."""
    world = draw(st.sampled_from(sorted(world_sizes)))
    mesh_shape = draw(st.sampled_from(_meshes(target, world)))
    kind = draw(st.sampled_from(CHECKPOINT_KINDS[target]))
    rarely = st.sampled_from([False] * 5 + [True])
    # a tied param has a key per module; FSDP1's flat params hide which keys alias
    untied = sorted(n for n in shapes if n.rsplit(".", 1)[0] not in tied)
    return Checkpoint(
        after=draw(st.integers(0, n_steps - 1)),
        kind=kind,
        world_size=world,
        mesh_shape=mesh_shape,
        target_options=draw(TARGET_OPTIONS.get(target, _no_options)(shapes, mesh_shape, tied, loading=True, kind=kind,
                                                                  **context)),
        split=draw(st.booleans()) if kind in STATE_DICT_KINDS else False,
        strict=not draw(st.booleans()) if kind in STATE_DICT_KINDS else True,
        # drawn last and rarely: the keys the load sees differ from the model's
        missing=(draw(st.sampled_from(untied)),) if kind in STATE_DICT_KINDS and untied and draw(rarely) else (),
        unexpected=kind in STATE_DICT_KINDS and draw(rarely),
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
    # flat: the optimizer may see flattened params (one group, nothing frozen)
    flat = target in MAY_FLATTEN and draw(st.booleans())
    depth = draw(st.integers(1, max_depth))
    n_groups = draw(st.integers(1, 1 if target in SINGLE_GROUP or flat else max_groups))
    n_steps = draw(st.integers(1, max_steps))
    mesh_shape = draw(st.sampled_from(_meshes(target, world)))
    model = draw(models(depth))
    shapes = param_shapes(model)
    if target in ELEMENTWISE_ONLY:
        optimizer_names = [n for n in optimizer_names or default_optimizers() if n not in NOT_ELEMENTWISE]
    optim = draw(optimizers(optimizer_names, device))
    if target not in NAMED_PARAMS:
        optim = dataclasses.replace(optim, named=False)
    names = [n for n, s in shapes.items() if len(s) == 2] if optim.name in ONLY_2D else list(shapes)
    groups = draw(param_groups(names, n_groups, optim))
    if target in SINGLE_GROUP or flat:
        assume(groups[0].params)  # an empty flat param list is refused by the plain optimizer too
    frozen = () if flat else tuple(n for n in shapes if draw(st.sampled_from([False] * 5 + [True])))
    tied = ("layers.0",) if model.tie_head else ()  # modules that own a tied param
    context = {"model": model, "n_groups": n_groups}
    if target in MAY_FLATTEN:
        context["flat"] = flat
    options = draw(TARGET_OPTIONS.get(target, _no_options)(shapes, mesh_shape, tied, **context))
    ck = None
    if target in CHECKPOINTS and (checkpoint or (checkpoint is None and draw(st.booleans()))):
        ck = draw(checkpoints(target, world_sizes, n_steps, shapes, tied, **context))
    # data parallel: every rank of either side gets an equal slice, in equal microbatches
    microbatches = max(options.get("microbatches", 1), ck.target_options.get("microbatches", 1) if ck else 1)
    ranks_per_sample = math.lcm(world, ck.world_size if ck else 1) * microbatches
    case = Case(
        target=target,
        world_size=world,
        mesh_shape=mesh_shape,
        model=model,
        optim=optim,
        groups=groups,
        schedule=draw(schedules(n_steps, list(shapes) if _flips_allowed(target, options, ck) else [])),
        frozen=frozen,
        batch=draw(st.integers(1, 2)) * ranks_per_sample if target in DATA_PARALLEL else draw(st.integers(1, 4)),
        seq=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(list(dtypes))),
        device=device,
        target_options=options,
        seed=draw(st.integers(0, 2**16 - 1)),
        checkpoint=ck,
    )
    if target in TO_DTYPE and draw(st.integers(0, 3)) == 3:  # drawn last: the draws before stay as they were
        other = "float64" if case.dtype == "float32" else "float32"
        case = dataclasses.replace(case, target_options={**case.target_options, "built_as": other})
    if target in NONROOT and "layers.0" in options.get("wrap", ()) and draw(st.booleans()):
        # a forward of the layers.0 unit from outside the root's (adds to the loss; see model.objective)
        case = dataclasses.replace(case, target_options={**case.target_options, "nonroot": True})
    if target not in ADD_PARAM_GROUP:
        return case
    # drawn last, so the draws before it stay as they were
    added = draw(st.integers(0, n_groups - 1))
    # mid-run (before a later step) now and then; right after the constructor when shrunk
    added_at = draw(st.integers(1, n_steps - 1)) if added and n_steps > 1 and draw(st.booleans()) else 0
    case = dataclasses.replace(case, optim=dataclasses.replace(optim, added_groups=added, added_at=added_at))
    if target in GENERATOR_GROUPS and draw(st.integers(0, 7)) == 7:  # rarely (and never when shrunk): a known trap
        case = dataclasses.replace(case, target_options={**options, "generator_groups": True})
    if target in JOIN and _joinable(case) and draw(st.integers(0, 3)) == 3:
        # uneven inputs under Join: rank r runs the first counts[r] steps, one rank all of them
        counts = [draw(st.integers(1, n_steps)) for _ in range(world)]
        counts[draw(st.integers(0, world - 1))] = n_steps
        case = dataclasses.replace(case, target_options={**case.target_options, "uneven": counts})
    return case


def _joinable(case: Case) -> bool:
    """Join applies with DDP averaging the grads (its join hook shadows the
    all-reduce), every trainable param used (a joined rank cannot tell an
    unused param's zero grad from a real one), no checkpoint, no param groups
    added and nothing frozen mid-run (a joined rank runs no schedule)."""
    return ("ddp" in case.target_options and case.world_size > 1 and len(case.schedule) > 1
            and case.checkpoint is None and not case.model.unused and not case.optim.added_groups
            and not any(s.freeze or s.unfreeze for s in case.schedule)
            and not case.target_options.get("generator_groups"))
