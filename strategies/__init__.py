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

from fuzzshard.case import Case, Checkpoint, Clip, Group, LRScheduler, Optim, Scaler, Step, mesh_shapes
from fuzzshard.kernel.state_io import ASYNC_SAVES, STATE_DICT_KINDS
from fuzzshard.kernel.model import param_shapes, tied_modules

from .loop import loop_features
from .models import dropouts, models
from .optimizers import NOT_ELEMENTWISE, ONLY_2D, default_optimizers, group_overrides, optimizer_kwargs

__all__ = ["cases", "checkpoints", "models", "optimizers", "param_groups", "schedules", "target_options", "spec_of",
           "valid"]

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
def optimizers(draw, names=None, device: str = "cpu", implementation: str | None = None) -> Optim:
    name = draw(st.sampled_from(names or default_optimizers()))
    kwargs = draw(optimizer_kwargs(name, device, implementation))
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


def target_options(target: str, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context):
    """The strategy of ``target``'s target_options (its spec's ``options``; {} if it has none)."""
    draw_options = spec_of(target).options
    return st.composite(draw_options)(shapes, mesh_shape, tied, **context) if draw_options else st.just({})


def spec_of(target: str):
    """What ``target`` can do (kernel/targets/base.py's Spec, declared in the target's module)."""
    return _target_class(target).spec


def _target_class(target: str):
    """``target``'s class (kernel/targets/base.py's Target): its hooks, where what a case is depends on the target."""
    from fuzzshard import targets

    return targets.get(target)


def _meshes(spec, world: int, mesh_dims: int = 2) -> list[tuple[int, ...]]:
    """The meshes drawn for ``world`` ranks: fewer dims first (shrinking goes there), at most ``mesh_dims``."""
    return [(world,)] if spec.flat_mesh else mesh_shapes(world, mesh_dims)


def _seq_multiple(spec, options: dict, mesh_shape: tuple, ck) -> int:
    """What the sequence length must be a multiple of, on either side of a checkpoint (1 for most)."""
    if not spec.seq_multiple:
        return 1
    return math.lcm(spec.seq_multiple(options, mesh_shape),
                    spec.seq_multiple(ck.target_options, ck.mesh_shape) if ck else 1)


def _flips_allowed(spec, options: dict, ck) -> bool:
    """A target that records which params require grad when it wraps (DDP,
    FSDP1) supports no requires_grad flips later."""
    fixed = spec.flags_fixed or (lambda _: False)
    return not fixed(options) and not (ck and fixed(ck.target_options))


def _loading_meshes(spec, world: int, mesh_dims: int, model) -> list[tuple[int, ...]]:
    """The meshes a checkpoint may load on: ``_meshes``, less those where an MoE's experts do not divide over the
    mesh dim the target shards them on (ep's Spec.moe "experts_over": the EP degree, its last dim)."""
    meshes = _meshes(spec, world, mesh_dims)
    over = (spec.moe or {}).get("experts_over")
    if over is None or model is None:
        return meshes
    from fuzzshard.kernel.moe import moe_configs_of

    experts = [c["experts"] for c in moe_configs_of(model)]
    return [m for m in meshes if all(e % m[over] == 0 for e in experts)]


@st.composite
def checkpoints(draw, target: str, world_sizes, n_steps: int, shapes: dict, tied: tuple = (), kinds=None,
                mesh_dims: int = 2, async_saves: bool = False, **context) -> Checkpoint:
    """A save point in the schedule, how the state is saved, and the loading
    side: any world size of the session (resharding), its own mesh and its
    own target options (another wrapping or placement). ``async_saves``: a
    DCP save may be ``dcp.async_save`` (kernel/state_io.py's ASYNC_SAVES;
    drawn last, so the draws without it stay as they were; on CPU only: the
    pool's groups on CUDA hold no CPU backend, which async_save needs)."""
    spec = spec_of(target)
    meshes = {w: _loading_meshes(spec, w, mesh_dims, context.get("model")) for w in sorted(world_sizes)}
    world = draw(st.sampled_from([w for w in sorted(world_sizes) if meshes[w]] or sorted(world_sizes)))
    mesh_shape = draw(st.sampled_from(meshes[world] or _meshes(spec, world, mesh_dims)))
    kind = draw(st.sampled_from(list(kinds or spec.checkpoint_kinds)))  # kinds: a session's schedule picks
    dsd = kind in STATE_DICT_KINDS
    rarely = st.sampled_from([False] * 5 + [True])
    # a tied param has a key per module; FSDP1's flat params hide which keys alias
    untied = sorted(n for n in shapes if n.rsplit(".", 1)[0] not in tied)
    return Checkpoint(
        after=draw(st.integers(0, n_steps - 1)),
        kind=kind,
        world_size=world,
        mesh_shape=mesh_shape,
        target_options=draw(target_options(target, shapes, mesh_shape, tied, loading=True, kind=kind, **context)),
        split=draw(st.booleans()) if dsd else False,
        strict=not draw(st.booleans()) if dsd else True,
        # drawn last and rarely: the keys the load sees differ from the model's
        missing=(draw(st.sampled_from(untied)),) if dsd and untied and draw(rarely) else (),
        unexpected=dsd and draw(rarely),
        # drawn last of all: "" (a blocking save) first, where a shrunk case goes
        async_save=draw(st.sampled_from(["", *ASYNC_SAVES])) if async_saves and kind == "dcp" else "",
    )


def moe_rules(spec) -> dict | None:
    """What MoE layers the target takes (its Spec's ``moe``), as moe_configs' arguments; None: no MoE drawn.
    ("local" is the AC draw's, kernel/ac.py ac_moe_problem, and "odds" the model's (moe_odds): no argument of
    the config's draw.)"""
    return None if spec.moe is None else {k: v for k, v in spec.moe.items() if k not in ("local", "odds")}


def moe_odds(spec) -> int:
    """One topology or decoder in this many has an MoE layer where the target takes one and the session asks
    for none in every case: its Spec.moe's "odds", models.py's MOE_ODDS where it says none."""
    from .models import MOE_ODDS

    return (spec.moe or {}).get("odds", MOE_ODDS)


@st.composite
def _model(draw, spec, depth: int, families=("topologies",), max_dim: int = 9, mesh_shape: tuple = (1,),
           aim: bool = False):
    """A plugin's model (only those a target names in ``spec.models``, if it
    does), or one of ``families``: a drawn topology (dims 1..``max_dim``), the
    decoder transformer. No plugin model and topologies alone: the draw is as it always was. ``aim``: a case aimed
    at the target's steered corner (Spec.corner) whose "experts_over" asks for an MoE: one, its experts dividing
    over that mesh dim."""
    from .models import USER, decoders, user_models

    names = [n for n in USER if n in spec.models] if spec.models else list(USER)
    if names and (spec.models or draw(st.booleans())):
        return draw(user_models(names))
    moe = moe_rules(spec)
    # "moe": an MoE in every case of the other families named (topologies where none is)
    always = "moe" in families and moe is not None
    families = [f for f in families if f != "moe"] or ["topologies"]
    family = draw(st.sampled_from(list(families))) if len(families) > 1 else families[0]
    if moe is not None and ({"always", "experts_over"} & set(moe)):  # ep's Spec.moe: every model has MoE, its
        # experts divide over a mesh dim (the EP degree)
        always = always or bool(moe.get("always"))
        over = moe.get("experts_over")
        moe = {k: v for k, v in moe.items() if k not in ("always", "experts_over")}
        if over is not None:
            moe["experts_multiple"] = mesh_shape[over]
    if aim and moe is not None and (spec.corner or {}).get("experts_over") is not None:
        always, moe = True, {**moe, "experts_multiple": mesh_shape[spec.corner["experts_over"]]}
    if family == "decoder":
        return draw(decoders(spec.max_depth or 2, moe, always, moe_odds(spec)))
    return draw(models(depth, max_dim, moe, always, moe_odds(spec)))


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
    implementation: str | None = None,
    models=("topologies",),
    compile: bool = False,
    ao: bool = False,
    steer: dict | None = None,
    mesh_dims: int = 2,
    dims_up_to_world: bool = False,
    loop=(),
    ac: bool = False,
    dropout: bool = False,
) -> Case:
    """``checkpoint``: None draws a save/load round trip into some cases, True
    into every case, False into none (targets whose spec has checkpoint kinds).
    ``implementation``: only for-loop, foreach or fused steps (where the optimizer has it).
    ``models``: the model families drawn ("topologies", "decoder"; strategies/models.py).
    ``compile``: targets that can (fsdp2) also draw torch.compile of blocks and of the optimizer step.
    ``ao``: fsdp2 also draws torchao's float8 Linears where torchao is installed (fuzzshard/kernel/float8.py).
    ``steer``: a timed session's weighted choices for this round (fuzzshard/session/schedule.py): ``plan``, (world
    size, None or (checkpoint kind, its world size)); ``optimizer by world``, world size -> (name,
    implementation) (pairs: the world size is drawn first); ``mesh``, world size -> mesh shapes; ``dtype``.
    Each a list, a cell as many times as its weight; ``ac``: activation checkpointing's forms; ``loop``: {"clip": forms, "lr_scheduler": classes}, weighted alike.
    ``mesh_dims``: meshes of up to this many dims (3: a simulated session's 2x2x2 and larger, simulate.py).
    ``dims_up_to_world``: a topology's dims drawn up to max(9, world size), not 9 (a simulated session's: at
    64 ranks, dims of 1-9 leave most shards empty); they shrink towards 1 as always.
    ``loop``: the training loop's features drawn around the step, of strategies/loop.py's FEATURES ("clip",
    "lr_scheduler", "scaler", "async_save"), where the target takes them; none by default (the draws stay as
    they were).
    ``ac``: activation checkpointing drawn too, on targets that take it (strategies/ac.py; drawn last, so the
    draws before stay as they were; off by default).
    ``dropout``: now and then dropout in the model, where the target draws it (its Spec's ``dropout``;
    strategies/models.py's ``dropouts``); False (the default): never, and the draws stay as they were."""
    spec = spec_of(target)
    steer = steer or {}
    plan = draw(st.sampled_from(steer["plan"])) if steer.get("plan") else None
    world = plan[0] if plan else draw(st.sampled_from(sorted(world_sizes)))
    # flat: the optimizer may see flattened params (one group, nothing frozen)
    flat = spec.may_flatten and draw(st.booleans())
    depth = draw(st.integers(1, spec.max_depth or max_depth))
    n_groups = draw(st.integers(1, 1 if spec.single_group or flat else max_groups))
    n_steps = draw(st.integers(1, max_steps))
    mesh_shape = draw(st.sampled_from((steer.get("mesh") or {}).get(world) or _meshes(spec, world, mesh_dims)))
    # a timed session's steered corner of the target's options (Spec.corner), where this mesh allows it: aimed there
    # or not (off first, so an aimed case shrinks to today's draw); no draw at all elsewhere (the draws stay)
    corner = spec.corner or {}
    aim = bool(steer.get("corner") and len(mesh_shape) == corner.get("mesh_dims")
               and draw(st.sampled_from(steer["corner"])))
    model = draw(_model(spec, depth, tuple(models), max(9, world) if dims_up_to_world else 9, mesh_shape, aim))
    shapes = param_shapes(model)
    if spec.elementwise_only:
        optimizer_names = [n for n in optimizer_names or default_optimizers() if n not in NOT_ELEMENTWISE]
    turns = (steer.get("optimizer by world") or {}).get(world)
    if turns:
        name, implementation = draw(st.sampled_from(turns))
        optimizer_names = [name]
    optim = draw(optimizers(optimizer_names, device, implementation))
    if ao and target == "fsdp2":  # --ao: now and then torchao's low-bit AdamW, on a widened model
        from fuzzshard.kernel.float8 import float8_available
        from fuzzshard.kernel.lowbit import draw_lowbit

        if float8_available():
            optim, model = draw(st.composite(draw_lowbit)(optim, model, mesh_shape))
            shapes = param_shapes(model)
    if not spec.named_params:
        optim = dataclasses.replace(optim, named=False)
    names = [n for n, s in shapes.items() if len(s) == 2] if optim.name in ONLY_2D else list(shapes)
    groups = draw(param_groups(names, n_groups, optim))
    if spec.single_group or flat:
        assume(groups[0].params)  # an empty flat param list is refused by the plain optimizer too
    frozen = () if flat else tuple(n for n in shapes if draw(st.sampled_from([False] * 5 + [True])))
    tied = tied_modules(model)  # modules that own a tied param
    context = {"model": model, "n_groups": n_groups}
    if compile and spec.compiled:  # the targets that draw torch.compile say how they name it
        context["compile"] = True
    # --ao: torchao's float8 (off where torchao is missing: one line at start; and with --checkpoints all, as float8
    # takes no checkpoint yet: float8_problem)
    if ao and target in ("fsdp2", "tp") and checkpoint is not True:
        from fuzzshard.kernel.float8 import float8_available

        if float8_available():
            context["ao"] = True
    if spec.may_flatten:
        context["flat"] = flat
    options = draw(target_options(target, shapes, mesh_shape, tied, **context, **({"aim": True} if aim else {})))
    # --ao's float8 (kernel/float8.py) runs float32 without a checkpoint (float8_problem): such a case takes neither,
    # and its float8 all-gather most often runs 2+ steps (a scale from the step before shows from the second step
    # on); the step count's extension shrinks to off. Without float8 (always without --ao) the draws stay as they were
    f8 = options.get("float8") if context.get("ao") else None
    if (f8 and f8.get("all_gather") and n_steps == 1 and max_steps > 1
            and draw(st.sampled_from([False, True, True, True]))):
        n_steps = draw(st.integers(2, max_steps))
    ck = None
    no_ck = f8 or aim and corner.get("checkpoint") is False  # (an aimed case whose corner takes none: none)
    if plan and plan[1] and not no_ck:
        kind = plan[1][0]
        # --ao: a low-bit optimizer's checkpoint goes through DCP (its quantized state saved and loaded as it is, the
        # load copying it into the new shards' state) two cases in three; shrunk: the kind the plan drew
        if (ao and kind != "dcp" and optim.name in _lowbit_names() and "dcp" in spec.checkpoint_kinds
                and draw(st.booleans())):
            kind = "dcp"
        ck = draw(checkpoints(target, [plan[1][1]], n_steps, shapes, tied, kinds=[kind], mesh_dims=mesh_dims,
                              async_saves="async_save" in loop and device == "cpu", **context))
    elif not plan and not no_ck and spec.checkpoint_kinds and (checkpoint or (checkpoint is None and draw(st.booleans()))):
        ck = draw(checkpoints(target, world_sizes, n_steps, shapes, tied, mesh_dims=mesh_dims,
                              async_saves="async_save" in loop and device == "cpu", **context))
    # data parallel: every rank of either side gets an equal slice, in equal microbatches
    split = _target_class(target).microbatches
    microbatches = max(split(options), split(ck.target_options) if ck else 1)
    ranks_per_sample = math.lcm(world, ck.world_size if ck else 1) * microbatches
    # (and a multiple of each side's own ranks x microbatches: 2 microbatches on one side, 3 on the other)
    ranks_per_sample = math.lcm(ranks_per_sample, world * split(options),
                                ck.world_size * split(ck.target_options) if ck else 1)
    case = Case(
        target=target,
        world_size=world,
        mesh_shape=mesh_shape,
        model=model,
        optim=optim,
        groups=groups,
        schedule=draw(schedules(n_steps, list(shapes) if _flips_allowed(spec, options, ck) else [])),
        frozen=frozen,
        batch=draw(st.integers(1, 2)) * ranks_per_sample if spec.data_parallel else
        draw(st.sampled_from(corner["batch"](mesh_shape))) if aim and "batch" in corner else draw(st.integers(1, 4)),
        seq=draw(st.integers(1, 3)) * _seq_multiple(spec, options, mesh_shape, ck),
        dtype="float32" if f8 and "float32" in dtypes else draw(st.sampled_from(steer.get("dtype") or list(dtypes))),
        device=device,
        target_options=options,
        seed=draw(st.integers(0, 2**16 - 1)),
        checkpoint=ck,
    )
    if spec.add_param_group:  # drawn after the rest of the case, so the draws before it stay as they were
        added = draw(st.integers(0, n_groups - 1))
        # mid-run (before a later step) now and then; right after the constructor when shrunk
        added_at = draw(st.integers(1, n_steps - 1)) if added and n_steps > 1 and draw(st.booleans()) else 0
        case = dataclasses.replace(case, optim=dataclasses.replace(optim, added_groups=added, added_at=added_at))
    if spec.late_options:  # the target's options that depend on the whole case: drawn last of all
        case = dataclasses.replace(case, target_options=spec.late_options(draw, case, **({"aim": True} if aim else {})))
    if loop:  # the training loop around the step (strategies/loop.py): after everything, so the draws before stay
        loop = _loop_taken(case, loop)
        case = dataclasses.replace(case, **draw(loop_features(spec, case, loop, steer.get("loop"))))
    if ac:  # activation checkpointing: after everything, so the draws before stay as they were
        from .ac import with_ac

        case = with_ac(draw, spec, case, steer.get("ac"))
    if spec.dropout and dropout:  # dropout (kernel/dropout.py), last of all: the draws before stay as they were
        with_dropout = dataclasses.replace(case, model=draw(dropouts(case.model)))
        if valid(with_dropout):  # a target's options that take no dropout (fsdp2's TP, compile) keep the case without
            case = with_dropout
    assume(valid(case))  # by construction above, but the rule has the last word (never a refused case)
    return case


def _lowbit_names() -> tuple:
    """torchao's low-bit optimizers' names (--ao; kernel/lowbit.py)."""
    from fuzzshard.kernel.lowbit import LOWBIT_OPTIMIZERS

    return tuple(LOWBIT_OPTIMIZERS)


def valid(case: Case) -> bool:
    """Whether ``case`` passes the validity rule (Case.check), the one every draw, edit and run asks."""
    return case.refusal() is None


# each loop feature in its plainest form: what the rule is asked of before the feature is drawn
_PLAIN_LOOP = {"clip": Clip(how="norm", max_norm=1.0), "lr_scheduler": LRScheduler("ConstantLR"), "scaler": Scaler()}


def _loop_taken(case: Case, features) -> tuple:
    """The loop features the rule lets ``case`` take (each tried in its plainest form), so a drawn case is
    valid by construction: ZeRO's uneven inputs under Join, drawn before the loop, take no clip, LR scheduler
    or scaler (its join hook steps a joined rank without them). Where the rule takes every feature (every
    other case) the features, and so the draws, are what they were."""
    return tuple(f for f in features
                 if f not in _PLAIN_LOOP or dataclasses.replace(case, **{f: _PLAIN_LOOP[f]}).refusal() is None)
