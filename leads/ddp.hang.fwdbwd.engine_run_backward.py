#!/usr/bin/env python
"""fuzzshard repro: hang: ranks [0, 1] still running after 10s, in rank 0: base.backward:_engine_run_backward; rank 1: base.backward:_engine_run_backward

This is the flattened kernel (fallback: ddp options ['gate']), not the straight-line script.

Run:   torchrun --nproc-per-node 2 THIS_FILE.py
Found with torch 2.13.0+cpu, backend gloo. Needs only torch.
Exit code 0: no divergence now; 1: the divergence reproduces (printed below).
The code below is fuzzshard's own kernel, flattened: it builds the model from
CASE, trains it sharded, then replays an unsharded reference anchored on the
sharded state before every step and compares (see the oracles section).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

# ---- fuzzshard.case --------------------------------------------------------
"""The Case: one fuzzed training setup as frozen, JSON-round-trippable data.

Nothing but a Case crosses a process boundary. Everything a run needs to be
rebuilt bit for bit is in it, seeds included (Hypothesis does not seed torch).
Free-form values (optimizer kwargs, target options) hold JSON-native types
only (lists, not tuples), so ``Case.from_json(c.to_json()) == c`` always.
"""

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Layer:
    """One node of the model tree.

    kinds with params: linear, embedding, layernorm, conv1d;
    activations: act (``act`` names it); composites: seq, residual (x + f(x)),
    twice (f(f(x)), one submodule called twice in a forward).
    """

    kind: str
    d_in: int = 0
    d_out: int = 0
    bias: bool = True
    act: str = ""
    kernel: int = 1
    children: tuple[Layer, ...] = ()


@dataclass(frozen=True)
class Model:
    input: str  # "features" (float [B, L, d_in]) or "tokens" (int [B, L], d_in = vocab)
    d_in: int
    layers: tuple[Layer, ...]
    tie_head: bool = False  # tokens only: output projection reuses the embedding weight
    unused: bool = False  # a submodule whose params never get a grad
    buffer: bool = False  # a registered buffer scales the output
    # a plugin's model (fuzzshard.plugin.model): its name and drawn sizes; layers stay empty.
    # Left out of the JSON when unset, so the built-in topologies' cases read as before
    factory: str = field(default="", metadata={"omit_default": True})
    sizes: dict[str, Any] = field(default_factory=dict, metadata={"omit_default": True})


@dataclass(frozen=True)
class Optim:
    name: str  # a torch.optim class name
    kwargs: dict[str, Any] = field(default_factory=dict)
    tensor_lr: str = ""  # "", "0d" (lr as a 0-d tensor) or "1d" (1-element tensor)
    named: bool = False  # pass (name, param) pairs, the named-params API
    added_groups: int = 0  # the last N groups go in through add_param_group after the constructor
    added_at: int = 0  # ... right before this schedule step (0: right after the constructor)

    @property
    def implementation(self) -> str:
        """Which step code runs: "fused", "foreach" or "forloop"."""
        return "fused" if self.kwargs.get("fused") else "foreach" if self.kwargs.get("foreach") else "forloop"


@dataclass(frozen=True)
class Group:
    params: tuple[str, ...]  # parameter FQNs, in the order handed to the optimizer
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    set_to_none: bool = True  # zero_grad(set_to_none=...) before this step
    freeze: tuple[str, ...] = ()  # requires_grad_(False) before this step
    unfreeze: tuple[str, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    """Save after step ``after``, load into a fresh model + optimizer on
    ``world_size`` ranks (mesh and target options of the loading side), go on.

    kind: "full" (get_state_dict full + cpu_offload, torch.save on rank 0,
    torch.load on every loading rank), "broadcast" (the same file read by
    rank 0 only, set_state_dict(broadcast_from_rank0=True)) or "dcp"
    (sharded state dict through torch.distributed.checkpoint on disk), or a
    target's own: "consolidate" (zero: consolidate_state_dict + state_dict()).
    """

    after: int
    kind: str
    world_size: int
    mesh_shape: tuple[int, ...]
    target_options: dict[str, Any] = field(default_factory=dict)
    split: bool = False  # set_model_state_dict + set_optimizer_state_dict instead of set_state_dict
    strict: bool = True
    # the model state dict as loaded lacks these params / holds an unexpected key (DSD kinds): a
    # strict load must refuse it, a non-strict one leaves the missing params as the fresh model has them
    missing: tuple[str, ...] = ()
    unexpected: bool = False
    # torch.distributed.checkpoint.async_save in place of dcp.save ("dcp" kind): "" (a blocking save), or one
    # of kernel/state_io.py's ASYNC_SAVES ("thread", "writer", "stager", "pinned"); training goes on while it
    # runs, and what loads is the state at the call
    async_save: str = field(default="", metadata={"omit_default": True})


@dataclass(frozen=True)
class Clip:
    """Gradient clipping between backward and the step, as a training loop does it."""
    how: str  # "norm": clip_grad_norm_; "two_part": get_total_norm then clip_grads_with_norm_ (torchtitan's
    # form, a DTensor norm made full in between); "value": clip_grad_value_; "own": the target's own (FSDP1's)
    max_norm: float  # the clip value, for "value"
    norm_type: str = "2"  # "1", "2", "3" or "inf" (a string: JSON has no infinity)
    foreach: bool | None = None
    error_if_nonfinite: bool = False


@dataclass(frozen=True)
class LRScheduler:
    """A torch.optim.lr_scheduler class over the case's optimizer, stepped after every optimizer step
    (ReduceLROnPlateau fed the step's loss). LambdaLR's lambda is named by its kwargs (kernel/loop.py)."""
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    children: tuple[LRScheduler, ...] = ()  # SequentialLR's and ChainedScheduler's schedulers


@dataclass(frozen=True)
class Overflow:
    """A non-finite grad where real training makes one (kernel/loop.py ``inject``): at schedule step
    ``step``, after backward and before ``unscale_``, element ``index`` (flat, row-major) of the full grad of
    param ``param`` is set to ``value`` ("inf", "-inf" or "nan"), or with ``layer`` every element of it (a
    float16 layer whose grads overflow). Only the ranks whose local grad holds that element see it: the
    owner of a sharded element alone (its shard of a reduce-scatter overflowed), every copy of a replicated
    one (a replica is made by a collective or by the same op on the same inputs, so it overflows on every
    rank that holds it). The scaler must then skip the step on every rank, as the reference, whose plain
    grad gets the same value in the same element, does: what ShardedGradScaler's all-reduce of found_inf is for."""
    step: int
    param: str
    index: int = 0
    value: str = "inf"
    layer: bool = False


@dataclass(frozen=True)
class Scaler:
    """Loss scaling (torch.amp.GradScaler, or ShardedGradScaler where a target uses it): scale the loss,
    unscale before clipping, skip a step whose grads are not finite, and move the scale."""
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    overflow: tuple[int, ...] = ()  # schedule steps whose loss is made infinite on purpose (a skipped step)
    # torch.amp.GradScaler where the target's own scaler is another (fsdp2: ShardedGradScaler; torchtitan's docs
    # pair FSDP2 with amp's, whose DTensor unscale reduces found_inf over the grads' mesh itself)
    amp: bool = field(default=False, metadata={"omit_default": True})
    # an overflow in some grads only (one element of one param, on the ranks that hold it), in place of the
    # whole-loss overflow at its step; left out of the JSON when none
    overflow_at: Overflow | None = field(default=None, metadata={"omit_default": True})


@dataclass(frozen=True)
class Case:
    target: str
    world_size: int
    mesh_shape: tuple[int, ...]
    model: Model
    optim: Optim
    groups: tuple[Group, ...]
    schedule: tuple[Step, ...]
    frozen: tuple[str, ...] = ()
    batch: int = 2
    seq: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    target_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    checkpoint: Checkpoint | None = None
    # the training loop around optimizer.step() (kernel/loop.py): left out of the JSON when unused
    clip: Clip | None = field(default=None, metadata={"omit_default": True})
    lr_scheduler: LRScheduler | None = field(default=None, metadata={"omit_default": True})
    scaler: Scaler | None = field(default=None, metadata={"omit_default": True})

    @property
    def ranks(self) -> int:
        """Processes the case needs: the larger of the saving and loading world."""
        return max(self.world_size, self.checkpoint.world_size if self.checkpoint else 0)

    def check(self) -> None:
        """The validity rule: CaseError (saying why) unless fuzzshard can run the case as a test. Said here
        once, and asked by everything that makes or takes a case: the strategies' draws (they draw within it
        by construction where cheap, and ``assume`` it at the end), the reducer's and the generalizer's edits,
        ``show``/``replay``/``script``/``bisect`` (cli/common.py's load_file), the pytest plugin's
        ``fuzzshard.testing.check`` and every worker before it runs a case (a refused case is an
        ``invalid`` verdict, never a finding). It covers every world size and mesh of the case, the added
        param groups, the loop's features against the schedule, where an async save can run
        (kernel/state_io.py) and the target's own refusals (its Spec's ``check``, e.g. ZeRO's uneven
        inputs under Join with a clip, scaler or LR scheduler)."""
        sides = [("", self.world_size, self.mesh_shape, self.target_options)]
        if self.checkpoint:
            sides.append(("checkpoint ", self.checkpoint.world_size, self.checkpoint.mesh_shape,
                          self.checkpoint.target_options))
        for what, world, mesh, options in sides:
            if world < 1 or not mesh:
                raise CaseError(f"{what}world size {world} is impossible")
            if math.prod(mesh) != world:
                raise CaseError(f"{what}mesh {mesh} does not hold {world} ranks")
            if tuple(mesh) not in mesh_shapes(world, 3):
                # the pool creates subgroups for these meshes only; a side of 1 is the smaller mesh
                raise CaseError(f"{what}mesh {list(mesh)}: {world} ranks take one of "
                                f"{[list(m) for m in mesh_shapes(world)]} (no side of 1)")
        if not 0 <= self.optim.added_groups < max(len(self.groups), 1):
            raise CaseError(f"{self.optim.added_groups} added param groups: the case has {len(self.groups)}")
        if not 0 <= self.optim.added_at < max(len(self.schedule), 1) or (self.optim.added_at and not self.optim.added_groups):
            raise CaseError(f"param groups added before step {self.optim.added_at}: the schedule has "
                            f"{len(self.schedule)} steps and {self.optim.added_groups} added groups")
        if self.scaler and self.optim.added_at:
            # GradScaler.unscale_ unscales the optimizer's params' grads only: a param that joins later keeps
            # a scaled grad (accumulated over the steps before it joins), which no user's loop steps with
            raise CaseError("a grad scaler with param groups added mid-run: their params' grads stay scaled")
        if self.scaler and not all(0 <= k < len(self.schedule) for k in self.scaler.overflow):
            raise CaseError(f"an overflow at steps {list(self.scaler.overflow)}: the schedule has {len(self.schedule)} steps")
        if self.scaler and self.scaler.overflow_at:
            at = self.scaler.overflow_at
            from .kernel.model import param_shapes

            shape = param_shapes(self.model).get(at.param)
            if not 0 <= at.step < len(self.schedule):
                raise CaseError(f"an overflow in {at.param}'s grad at step {at.step}: the schedule has {len(self.schedule)} steps")
            if shape is None:
                raise CaseError(f"an overflow in {at.param}'s grad: the model has no such param")
            if not 0 <= at.index < max(math.prod(shape), 1) or at.value not in ("inf", "-inf", "nan"):
                raise CaseError(f"an overflow of {at.value!r} at element {at.index} of {at.param} "
                                f"({math.prod(shape)} elements; inf, -inf or nan)")
        if self.checkpoint and not 0 <= self.checkpoint.after < len(self.schedule):
            raise CaseError(f"checkpoint after step {self.checkpoint.after}: the schedule has {len(self.schedule)} steps")
        from .kernel.state_io import async_save_problem  # where an async save can run is said beside it

        problem = async_save_problem(self)
        if problem:
            raise CaseError(problem)
        from . import targets  # what this target's options may be is said in its module

        check = targets.get(self.target).spec.check if self.target in targets.names() else None
        problem = check(self) if check else None
        if problem:
            raise CaseError(problem)

    check_world = check  # its old name (the world sizes and meshes were all it checked once)

    def refusal(self) -> str | None:
        """Why the validity rule (``check``) refuses the case, None where it takes it."""
        try:
            self.check()
        except CaseError as e:
            return str(e)
        return None

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **_to_jsonable(self)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Case:
        data = dict(data)
        fmt = data.pop("format", FORMAT_VERSION)
        if fmt != FORMAT_VERSION:
            raise CaseError(f"case format {fmt} is not supported (this fuzzshard reads {FORMAT_VERSION})")
        return _from_jsonable(cls, data, "case")

    @classmethod
    def from_json(cls, text: str) -> Case:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CaseError(f"not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise CaseError("a case must be a JSON object")
        return cls.from_dict(data)


def mesh_shapes(world: int, dims: int = 2) -> list[tuple[int, ...]]:
    """Meshes a world size can take: 1-D, then each 2-D factorisation with both
    sides > 1, then (``dims`` 3) each 3-D one with every side > 1 (8 ranks and
    more: what a simulated session draws, strategies' ``mesh_dims``)."""
    two = [(a, world // a) for a in range(2, world) if world % a == 0]
    three = [(a, b, c // b) for a, c in two for b in range(2, c) if c % b == 0] if dims >= 3 else []
    return [(world,)] + two + three


class CaseError(ValueError):
    """A case that cannot be read: bad JSON, a missing field, a wrong type."""


def _to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_default") and getattr(value, f.name) == _default(f))}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    return value


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_TYPE_HINTS: dict = {}


def _type_hints(tp) -> dict:
    """typing.get_type_hints, once per class: it evaluates every annotation's
    string each call, about a millisecond of every case a worker reads."""
    if tp not in _TYPE_HINTS:
        _TYPE_HINTS[tp] = typing.get_type_hints(tp)
    return _TYPE_HINTS[tp]


def _from_jsonable(tp: Any, value: Any, where: str) -> Any:
    """Rebuild a value of type ``tp`` from JSON data, with a clear error path."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_jsonable(tp, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise CaseError(f"{where}: expected an object, got {type(value).__name__}")
        hints = _type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise CaseError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _from_jsonable(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CaseError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):
            raise CaseError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_from_jsonable(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise CaseError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp in (int, float, str, bool):
        ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise CaseError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return value


# ---- fuzzshard.kernel.mesh -------------------------------------------------
"""Process groups and meshes for one case, the same in the pool and in a repro.

A case of world size W runs on ranks 0..W-1 of a larger world (the pool, or
torchrun with as many ranks as the case's larger side when it reshards).
Subgroups are created once, by every rank, in one order: creating them per
case deadlocks once ranks have made different numbers of groups. Each case
gets fresh DeviceMeshes over those groups, and ``job(w)`` makes ranks 0..w-1
the default group for the phase that runs on them, so torch code that uses
the default group (DCP, broadcast_from_rank0) sees a job of exactly w ranks.

A pool that runs cases side by side (runner.Pool.run_many) places a case on
ranks o..o+W-1 instead: ``placed(o, W)`` makes those ranks the world the case
sees, ranks 0..W-1 by every name torch has for a rank, so the case runs as it
would on ranks 0..W-1 and as its repro runs it under torchrun.

``World`` is the seam between the kernel and where its ranks run: what
kernel/run.py asks of the ``meshes`` it is handed. ``Meshes`` here is the
world of real process groups (one rank a process); kernel/simulated.py's
``SimulatedWorld`` runs every rank of a case in one process under
LocalTensorMode (``fuzz --simulate``) behind the same interface.
"""

import contextlib
import math

import torch
import torch.distributed as dist



def _slices(shape: tuple[int, ...]) -> list[list[list[int]]]:
    """Per mesh dim, the rank lists of the 1-D slices along it."""
    ranks = torch.arange(math.prod(shape)).view(*shape)
    return [ranks.movedim(d, -1).reshape(-1, shape[d]).tolist() for d in range(len(shape))]


def rank_sets(size: int, placed: bool = False) -> list[tuple[int, ...]]:
    """Every rank set a case on ``size`` ranks can need as a mesh dim or a job
    (0..w-1 is the 1-D mesh of w), in a fixed order; ``placed``: on ranks
    o..o+w-1 too, for every offset o that fits."""
    out = set()
    for w in range(1, size + 1):
        for o in range(size - w + 1 if placed else 1):
            for shape in mesh_shapes(w, 3):
                for dim in _slices(shape):
                    out.update(tuple(r + o for r in s) for s in dim)
    return sorted(out, key=lambda s: (len(s), s))


class World:
    """What kernel/run.py asks of the world a case runs in. The mesh part:
    ``placed(offset, n)`` (the case's world while it runs), ``group(w)``,
    ``mesh(w, shape)`` and ``job(w)`` (ranks 0..w-1 as the default group
    around what they run). The hooks below have the defaults of real process
    groups, where each rank is a process of its own; a world that runs several
    ranks in one process (kernel/simulated.py) says otherwise."""

    def made_alike(self, make):
        """What every rank makes alike (the model before sharding, a step's
        batch), each from the same seed: ``make()`` on each rank, here."""
        return make()

    def observed(self, obs):
        """What the reporting rank holds of the sharded run's observations ``obs`` (None: none kept)."""
        return obs

    def batchable(self, t) -> bool:
        """Whether gather.py may fold ``t``'s full copy into its one batched all-gather
        (``gather_batch(allowed=...)``); else it is gathered on its own (``full_tensor()``)."""
        return True

    @contextlib.contextmanager
    def placed(self, offset: int, n: int):
        yield

    def group(self, w: int):
        raise NotImplementedError

    def mesh(self, w: int, shape: tuple[int, ...]):
        raise NotImplementedError

    @contextlib.contextmanager
    def job(self, w: int):
        yield


class Meshes(World):
    """Every subgroup a case can need, created collectively once."""

    def __init__(self, size: int, device_type: str, placed: bool = False):
        self.device_type = device_type
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in rank_sets(size, placed)}
        self.offset = 0  # the case's rank 0 in the real world (placed())

    def group(self, w: int):
        return self.groups[tuple(range(self.offset, self.offset + w))]

    def mesh(self, w: int, shape: tuple[int, ...]):
        """A fresh DeviceMesh over ranks 0..w-1 (never init_device_mesh, which
        would take the whole world)."""
        from torch.distributed.device_mesh import DeviceMesh

        me, o = dist.get_rank(), self.offset  # the rank in the case's own world (placed())
        dim_groups = [self.groups[tuple(r + o for r in next(s for s in dim if me in s))] for dim in _slices(shape)]
        ranks = torch.arange(w).view(*shape)
        if len(dim_groups) == 1:
            mesh = DeviceMesh.from_group(dim_groups[0], self.device_type, mesh=ranks)
        else:
            names = tuple(f"d{i}" for i in range(len(dim_groups)))
            mesh = DeviceMesh.from_group(dim_groups, self.device_type, mesh=ranks, mesh_dim_names=names)
        if o:
            # DTensor caches sharding decisions by mesh equality, and a cached spec keeps the first mesh
            # object, its groups and this process's coordinate in it: torch takes both to be the same in
            # any equal mesh. A placed mesh has the same rank map as one at offset 0 but other groups and
            # coordinates, so it carries its offset in the one part of the key meant for several ranks
            # of one process (threaded process groups). Its submeshes would not: 2-D meshes are never
            # placed (runner.placeable).
            mesh._thread_id = ("fuzzshard-offset", o)
        return mesh

    @contextlib.contextmanager
    def job(self, w: int):
        """Ranks 0..w-1 as the default group, as if torchrun had started w ranks."""
        from torch.distributed import distributed_c10d as c10d

        saved = c10d._world.default_pg
        c10d._world.default_pg = self.group(w)
        try:
            yield
        finally:
            c10d._world.default_pg = saved

    @contextlib.contextmanager
    def placed(self, offset: int, n: int):
        """Ranks offset..offset+n-1 as the whole world, ranks 0..n-1, while a
        case runs there: the default group is theirs, and every group's map from
        global to group ranks is shifted down by ``offset``, so what torch says
        or takes as a global rank (get_rank(), a DeviceMesh's ranks, DCP's
        coordinator, a broadcast's src) is the case's own. Offset 0 changes
        nothing: the case's world is already ranks 0..n-1 there."""
        if offset == 0:
            yield
            return
        from torch.distributed import distributed_c10d as c10d

        ranks = c10d._world.pg_group_ranks
        saved = {g: ranks[g] for g in self.groups.values() if g in ranks}
        saved_pg = c10d._world.default_pg
        for g, m in saved.items():
            ranks[g] = {r - offset: gr for r, gr in m.items()}
        self.offset = offset
        c10d._world.default_pg = self.group(n)
        try:
            yield
        finally:
            c10d._world.default_pg = saved_pg
            self.offset = 0
            ranks.update(saved)


# ---- fuzzshard.versions ----------------------------------------------------
"""Which torch releases fuzzshard runs on, and every difference between them
that fuzzshard's own code has to know: one place, so a new release's change is
one function here and not a check scattered through the kernel.

The range is measured, not guessed (docs/versions.md): a clean session per
target and ``fuzzshard known --check`` on each release in ``TESTED``. Below
``FLOOR`` the CLI refuses to start, with one line naming the floor.

Standard library only at the top (torch is imported inside the functions):
the kernel imports this module, so it is flattened into repro scripts too.
"""

import re

FLOOR = (2, 9)  # the oldest release fuzzshard supports (docs/versions.md says why)
# the releases a clean session per target and `known --check` were run on (docs/versions.md, known/README.md)
TESTED = ("2.9.0", "2.9.1", "2.10.0", "2.13.0", "2.14.1", "2.15.0")  # 2.15.0, 2.9.1: docs/versions.md, bisect


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13), "2.16.0.dev20260101" -> (2, 16)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def installed_torch() -> str | None:
    """The installed torch's version without importing it (the CLI's start stays fast), None if none."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        try:
            import torch
        except ImportError:
            return None
        return torch.__version__


def too_old(version: str | None = None) -> str | None:
    """One line saying why this torch cannot run fuzzshard (below the floor, or none), None when it can."""
    version = installed_torch() if version is None else version
    floor = ".".join(map(str, FLOOR))
    if version is None:
        return f"torch is not installed; fuzzshard needs torch>={floor}"
    if release(version) < FLOOR:
        return f"torch {version} is older than fuzzshard's floor, torch {floor} (pip install 'torch>={floor}')"
    return None


# ---- API differences between releases -------------------------------------

def shard_size_and_offset(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(length, offset) of chunk ``index`` of a dim of ``size`` split as Shard splits it over ``chunks``
    ranks: ``Shard.local_shard_size_and_offset`` from 2.9 on, the private ``_local_shard_size_and_offset``
    (same arguments and result) in 2.8."""
    from torch.distributed.tensor import Shard

    f = getattr(Shard, "local_shard_size_and_offset", None) or Shard._local_shard_size_and_offset
    return tuple(f(size, chunks, index))


# ---- fuzzshard.verdict -----------------------------------------------------
"""Typed verdicts: what one case came to, as the oracles record it.

The JSON on disk (finding files, the known list, repro scripts' output) stays
the dict it always was; these types read it and write it back unchanged
(``Verdict.from_dict(d).to_dict() == d``), so code can say ``v.first.fqn``
instead of ``v["first"]["fqn"]``. Standard library only: the kernel's repro
scripts may carry them. Keys a type does not name ride along in ``extra``.
"""

from dataclasses import dataclass, field, fields

STATUSES = ("pass", "finding", "invalid", "error")


class _Record:
    """A dict on disk as a dataclass: its named keys as fields, the rest in
    ``extra``; ``keys`` remembers which named keys the dict had (None is a
    value too), so writing it back gives the same dict; a field set since
    (not None) is written too."""

    @classmethod
    def from_dict(cls, d: dict):
        names = _names(cls)
        return cls(**{k: d[k] for k in names if k in d}, extra={k: v for k, v in d.items() if k not in names},
                   keys=tuple(k for k in names if k in d))

    def to_dict(self) -> dict:
        def kept(k: str) -> bool:  # the fields set, and those a dict it was read from had (None or not)
            return getattr(self, k) is not None or (self.keys is not None and k in self.keys)

        return {**{k: getattr(self, k) for k in _names(type(self)) if kept(k)}, **self.extra}


def _names(cls) -> list[str]:
    return [f.name for f in fields(cls) if f.name not in ("extra", "keys")]


@dataclass
class Mismatch(_Record):
    """One compared quantity that differs: ``quantity`` (loss, grad, param,
    state.NAME, group, ...) of ``fqn`` after ``step``, ``detail`` in words;
    the numbers (``max_abs``, ``tolerance``, ...) in ``extra``."""
    quantity: str
    fqn: str
    step: int
    detail: str
    extra: dict = field(default_factory=dict)
    keys: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class ErrorRecord(_Record):
    """An exception (or a death, a hang) as a verdict holds it: its ``type``
    and ``message``; ``phase``, ``traceback``, ``text`` or ``log`` where the
    oracle recorded them."""
    type: str
    message: str
    phase: str | None = None
    traceback: str | None = None
    extra: dict = field(default_factory=dict)
    keys: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class Verdict(_Record):
    status: str  # one of STATUSES
    oracle: str | None = None  # which oracle found it (findings.ORACLES), for a finding
    first: Mismatch | None = None  # parity and checkpoint: the first mismatch ...
    mismatches: list[Mismatch] | None = None  # ... and all of them (as many as recorded)
    error: ErrorRecord | str | None = None  # error_parity, crash, hang; a bare string for status "error"
    rank: int | None = None  # the rank that reported it
    # where a finding stands in its session (findings/life.py), said by the session, never by an oracle:
    timeout: float | None = None  # a hang seen under a shortened limit (seconds): provisional until re-run at the full one
    unconfirmed: bool | None = None  # no time was left to re-run it in fresh workers
    extra: dict = field(default_factory=dict)  # count, stuck_ranks, where, reason, ...
    keys: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def is_finding(self) -> bool:
        return self.status == "finding"

    @property
    def error_record(self) -> ErrorRecord:
        """Its error as a record: an empty one where it has none, or only a message (status "error")."""
        return self.error if isinstance(self.error, ErrorRecord) else ErrorRecord("", "")

    @property
    def quantity(self) -> str:
        """What its first mismatch is of (loss, grad, param, state.NAME, ...), "" without one."""
        return self.first.quantity if self.first else ""

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        if d.get("status") not in STATUSES:
            raise ValueError(f"a verdict's status is one of {STATUSES}, not {d.get('status')!r}")
        d = dict(d)
        if isinstance(d.get("first"), dict):
            d["first"] = Mismatch.from_dict(d["first"])
        if isinstance(d.get("mismatches"), list):
            d["mismatches"] = [Mismatch.from_dict(m) for m in d["mismatches"]]
        if isinstance(d.get("error"), dict):
            d["error"] = ErrorRecord.from_dict(d["error"])
        return super().from_dict(d)

    def to_dict(self) -> dict:
        out = super().to_dict()
        for key in ("first", "error"):
            if hasattr(out.get(key), "to_dict"):
                out[key] = out[key].to_dict()
        if out.get("mismatches") is not None:
            out["mismatches"] = [m.to_dict() if hasattr(m, "to_dict") else m for m in out["mismatches"]]
        return out



# What the oracles build: every verdict a case can come to is made by one of
# these (the kernel, the runner and the worker), so its shape is said once.

def passing() -> dict:
    return Verdict("pass").to_dict()


def invalid(reason: str, error: dict | None = None) -> dict:
    """The case is no test: the reference rejects or raises too, or a documented refusal."""
    return Verdict("invalid", error=error, extra={"reason": reason}).to_dict()


def failure(message: str, traceback_text: str | None = None) -> dict:
    """fuzzshard itself failed (a bug here or in a setup file), not the case."""
    return Verdict("error", error=message, extra={"traceback": traceback_text} if traceback_text else {}).to_dict()


def finding(oracle: str, mismatches: list[dict] | None = None, error: dict | None = None, **extra) -> dict:
    """A finding of ``oracle`` (findings.ORACLES): its mismatches (the first,
    up to MAX_REPORTED of them and their count), or its error record."""
    if mismatches:
        return Verdict("finding", oracle, first=mismatches[0], mismatches=mismatches[:MAX_REPORTED],
                       extra={"count": len(mismatches), **extra}).to_dict()
    return Verdict("finding", oracle, error=error, extra=extra).to_dict()


MAX_REPORTED = 8  # mismatches a finding keeps (its count says how many there were)


def error_record(e: BaseException) -> dict:
    """An exception as a verdict holds it (ErrorRecord): type, first line of
    the message, a short text, the traceback's tail."""
    import traceback

    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)][0]
        if isinstance(inner, BaseException):
            out = error_record(inner)
            out["traceback"] = (out["traceback"] + "".join(traceback.format_exception(e)))[-4000:]
            return out
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ErrorRecord(type(e).__name__, msg[:500], traceback="".join(traceback.format_exception(e))[-4000:],
                       extra={"text": f"{type(e).__name__}: {msg[:300]}"}).to_dict()


# ---- fuzzshard.kernel.oracles ----------------------------------------------
"""Oracles: pure comparisons of what the sharded run did against the reference.

Tolerances are derived, never tuned. ``u`` is the unit roundoff of the dtype.
- *step*: the reference optimizer step starts from exactly the sharded
  params, state and grads (the reference is re-anchored every step), so the
  only legitimate difference is elementwise rounding of the same formulas
  (vectorised vs scalar tails, fused multiply-add): ``STEP_ULPS * u``, times
  the reduction length for optimizers that reduce over a param (Adafactor).
- *reduction*: loss and grads come from the same params and data but a
  different reduction order (sharded matmuls, collectives). Summing n terms
  in any order errs by at most ``n * u * sum|terms|`` (Higham); n is the
  longest reduction in the model times its depth, counted for both runs.
  ``sum|terms|`` is not visible in a result that cancels (a bias feeding a
  LayerNorm has an analytic grad of 0), so the bound also carries the
  tensor's *measured sensitivity*: how far it moves when every param and
  input is nudged by one ulp. Rounding inside a run acts like such nudges.
- *Partial grads*: a grad left Partial (unreduced) is reduced again by each
  optimizer op that reads it, in its own order; where its partials cancel
  the step is legitimately undetermined. The step bound of such a param
  grows by ``4 * r * |update|`` per element (state: ``4 * r * |state|``),
  r being the relative reduction error ``(2(n-1)+1) u sum|partials| / |g|``.
An element fails when ``|got - want| > atol + rtol * |want|`` with
``rtol = k*u`` and ``atol = k*u*max|want| + k*sensitivity``.
"""

import math

import torch


UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
# The error of one rounding whose result underflows (half the spacing of the dtype's subnormal numbers):
# below the smallest normal number u*|x| no longer bounds a rounding (float16's normals end at 6.1e-5)
UNDERFLOW = {
    "float64": 2.0**-1075,
    "float32": 2.0**-150,
    "bfloat16": 2.0**-134,
    "float16": 2.0**-25,
}
STEP_ULPS = 16


def step_tolerance(dtype: str, reduce_len: int = 1) -> dict:
    k = STEP_ULPS * reduce_len
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[dtype], "why": f"same inputs, elementwise rounding: {k} ulps of {dtype}"}


def compiled_step_tolerance(tol: dict, dtype: str, betas, scalar_dtype: str | None = None) -> dict:
    """``tol`` for an optimizer step run under torch.compile. Eager evaluates a
    step's scalar factors (Adam's bias corrections 1 - beta^t, their square
    roots, lr / correction) as Python doubles: ``optimizer._get_value(step)``
    is ``step.item()``. Compiled, ``_get_value`` returns the ``step`` tensor
    itself (torch/optim/optimizer.py, ``_get_value``), so they are 0-dim
    tensors of *the step's dtype*, ``scalar_dtype``: ``_get_scalar_dtype()``,
    float32 unless the default dtype is float64, whatever the params' dtype (a
    Python float meeting a 0-dim float32 tensor stays float32). So u below is
    the unit roundoff of ``scalar_dtype``, not of ``dtype``: a float64 case's
    compiled step has float32 scalars (measured, float64 params: Adam 168,
    Adamax 6, Adagrad 1 float32 ulps of |update| apart from eager, 1e-10 to
    1e-7 on 1e-2 updates; the same step compiled with float64 step tensors
    matches eager to 2e-16). beta rounds to the scalar dtype (u), its t-th power errs by t u
    more (plus u), and 1 - beta^t cancels, so its relative error is
    ((t + 2) beta^t / (1 - beta^t) + 1) u, largest at t = 1: 3 beta / (1 - beta) + 1
    (beta2 = 0.999: about 3000 u). Each correction enters the update at most
    once; a few more roundings add 4 u: lr and lr / correction (2 u), the
    square root of the second one (u); Adagrad's lr / (1 + (t-1) lr_decay)
    errs by 3 u + 2 u x / (1 + x), x = (t-1) lr_decay, under 4 u while x < 1.
    The param may then differ by that relative error of its update,
    ``update_rel * |update|`` per element, on top of the elementwise bound
    (per param, from its own group's betas: ``compiled_step_allowance``).
    Why it hides no bug: the allowance is relative to the update, so a step
    that is wrong by more than the scalars' own rounding (a correction one
    step off, a missing term) still fails, and the params' elementwise math
    (float64 in a float64 case) keeps its 16 ulps of ``dtype``.
    Not covered: RAdam's rectification, whose rho_t = rho_inf - 2 t beta2^t /
    (1 - beta2^t) cancels far worse; it applies from rho_t > 5 (step 5 or
    later), past the strategies' three steps, and needs its own bound first."""
    scalar_dtype = scalar_dtype or dtype
    u = UNIT_ROUNDOFF[scalar_dtype]
    rel = compiled_update_rel(betas, u)
    return {**tol, "update_rel": rel, "scalar_dtype": scalar_dtype,
            "why": tol["why"] + f"; compiled step: + {rel:.3g} x |update| (its scalar factors in {scalar_dtype}: "
                                f"1 - beta^t for betas {list(betas)}, at t = 1)"}


def compiled_update_rel(betas, u: float) -> float:
    """The relative error of a compiled step's update from its scalar factors
    (``compiled_step_tolerance``): (sum over betas of (3 beta / (1 - beta) + 1) + 4) u."""
    return (sum(3 * b / (1 - b) + 1 for b in betas if 0 < b < 1) + 4) * u


# NAdam's two coefficients (besides the bias correction of beta2), in roundings
# of the scalar dtype: ``compiled_step_allowance``
NADAM_COEF_ULPS = 23
# State torch.optim keeps as 0-dim tensors of the scalar dtype and a compiled
# step computes from ``step`` in that dtype (eager: in doubles, rounded once)
SCALAR_STATE = ("step", "eta", "mu", "mu_product")


def compiled_step_allowance(tol: dict, optim: str, group: dict | None, update, prev=None, grad=None,
                            state: dict | None = None):
    """Elementwise allowance for a param after a compiled step (on top of the
    16-ulp bound of ``tol``), ``tol`` from ``compiled_step_tolerance``; u is
    the unit roundoff of its scalar dtype. ``group``: the param's group in the
    reference optimizer (its own betas and lr), ``update`` |new - prev| there,
    ``prev`` the param before the step, ``grad`` its grad, ``state`` its state
    after the step.
    - ``compiled_update_rel(group betas) * |T|``: one multiplicative scalar
      factor (Adam, AdamW, Adamax, Adagrad, ...) of the update's term T:
      the update itself, or with a decoupled weight decay (p (1 - lr wd) + T,
      the decay a double in both runs) |update| + lr wd |prev| >= |T|: where
      decay and T cancel, |update| alone is no measure of T's error (measured:
      30 times the bound, AdamW lr 3e-4, wd 0.5).
    - NAdam adds two terms, T1 = -lr (1 - mu) / (1 - Pi) g / d and
      T2 = -lr mu' / (1 - Pi') m / d, each with its own float32 coefficient;
      where they cancel (T1 = -T2 to 1e-3) |update| is no measure of their
      error (measured: 434 u of |update|, 2.1 u of |T1| + |T2|). So the
      allowance is (3 beta2 / (1 - beta2) + 1 + 23) u (|T1| + |T2|): d holds
      the correction of beta2; mu = beta1 (1 - 0.5 0.96^(t psi)) errs by 5 u
      (0.96 and psi round, t psi, the power, 1 - 0.5 y around 0.5 (3 u), beta1
      and the product), 1 - mu and 1 - Pi (mu, Pi <= 0.5: no cancellation) by
      6 u and 8 u, with lr and two products c1 by 17 u; Pi' = Pi mu' by 13 u,
      so c2 = lr mu' / (1 - Pi') by 22 u; 23 u covers both, the square root 1.
    - ASGD's for-loop step scales the param by ``1 - lambd * eta`` with eta a
      scalar-dtype tensor: compiled, the factor itself is rounded to the
      scalar dtype (eager: a double), ``2 u |prev|`` more (its rounding and
      lambd's, lambd * eta <= 0.5). This is as coarse as a float32 step: the
      decay term lambd * eta * |p| is only checked to u / (lambd * eta) of
      itself; the foreach step multiplies by the eta tensor and matches eager.
    Why none hides a bug: each is the rounding of a scalar the compiled step
    computes in the scalar dtype, times the magnitude it multiplies; a wrong
    step count, a wrong or missing term changes the param by far more (a bias
    correction one step off: tens of percent of the update; float32 u is 6e-8).
    Adamax corrects beta1 only (its beta2 scales exp_inf, a double both ways);
    a param the step skips (no grad) gets nothing."""
    if grad is None:
        return torch.zeros_like(update)
    u = UNIT_ROUNDOFF[tol.get("scalar_dtype") or "float64"]
    group = group or {}
    betas = tuple(group.get("betas", ()))
    if optim == "Adamax":
        betas = betas[:1]
    if optim == "NAdam" and state and "mu_product" in state and len(betas) == 2:
        terms = _nadam_terms(group, prev, grad, state)
        b2 = betas[1]
        rel_b2 = 3 * b2 / (1 - b2) + 1 if 0 < b2 < 1 else 0
        return (rel_b2 + NADAM_COEF_ULPS + 1) * u * terms
    scaled = update
    wd = group.get("weight_decay", 0)
    if group.get("decoupled_weight_decay") and wd and prev is not None:
        # p (1 - lr wd) + T: the decay is a double both ways, only T carries the
        # scalar factors, and where the two cancel |update| is no measure of |T|
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        scaled = update + lr * wd * prev.detach().abs().to(update.device, update.dtype)
    out = compiled_update_rel(betas, u) * scaled
    if optim == "ASGD" and not group.get("foreach") and prev is not None:
        out = out + 2 * u * prev.detach().abs().to(out.device, out.dtype)
    return out


def compiled_state_allowance(optim: str, group: dict | None, key: str, param_allowance):
    """A state tensor that a compiled step derives from the new param: ASGD's
    average ax + mu (p - ax), mu <= 1, inherits at most the param's allowance
    (``compiled_step_allowance``); None for every other state."""
    if optim == "ASGD" and key == "ax" and not (group or {}).get("foreach"):
        return param_allowance
    return None


def _nadam_terms(group: dict, prev, grad, state: dict):
    """|T1| + |T2| of NAdam's step (torch/optim/nadam.py), in float64 from the
    state after it: m = exp_avg, v = exp_avg_sq, Pi = mu_product, t = step."""
    f = lambda x: float(x.item()) if isinstance(x, torch.Tensor) else float(x)  # noqa: E731
    lr, (b1, b2), eps = f(group["lr"]), (f(b) for b in group["betas"]), f(group["eps"])
    psi, wd = f(group["momentum_decay"]), f(group.get("weight_decay", 0.0))
    t, pi = f(state["step"]), f(state["mu_product"])
    g = grad.detach().double()
    if group.get("maximize"):
        g = -g
    if wd and not group.get("decoupled_weight_decay"):
        g = g + wd * prev.detach().double().to(g.device)
    mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    d = (state["exp_avg_sq"].detach().double() / (1 - b2 ** t)).sqrt() + eps
    t1 = lr * (1 - mu) / (1 - pi) * g.abs() / d
    t2 = lr * mu_next / (1 - pi * mu_next) * state["exp_avg"].detach().double().abs() / d
    return t1 + t2


def compiled_scalar_state_tolerance(tol: dict) -> dict:
    """``tol`` for a scalar state (``SCALAR_STATE``: step, ASGD's eta and mu,
    NAdam's mu_product) after a compiled step: it computes them from ``step``
    in the scalar dtype (eta = lr / (1 + lambd lr t)^alpha: about 10 roundings;
    mu_product * mu: 8) where eager rounds a double once, so they are held to
    16 ulps of the scalar dtype, the same whatever their storage dtype (a
    loaded checkpoint stores them in the param's). A step count one off still
    fails (16 ulps of float32 of t <= 3 is 3e-6); eta one step off differs by
    alpha lambd lr / (1 + lambd lr t) of itself, caught where that is above
    16 u (lambd lr >= 1e-5 in float32)."""
    u = max(tol["u"], UNIT_ROUNDOFF[tol.get("scalar_dtype") or "float64"])
    return {**tol, "u": u, "why": tol["why"] + f"; a scalar state: {tol['k_ulps']} ulps of {tol.get('scalar_dtype')}"}


def reduction_tolerance(dtype: str, n: int) -> dict:
    k = 2 * n
    return {
        "k_ulps": k,
        "u": UNIT_ROUNDOFF[dtype],
        "why": f"reordered reductions of length <= {n} on both sides: 2*{n} ulps of {dtype}",
    }


def mixed_precision_tolerance(compute: str, reduce: str, world: int, microbatches: int = 1) -> dict:
    """fsdp2 mixed precision: W per-rank grads computed in ``compute``, each the
    sum of ``microbatches`` grads accumulated in ``reduce`` (m-1 roundings),
    summed in ``reduce`` with a pre- and a post-divide and cast back (W+2
    roundings); both sides, so 2(W+1) + 2(m-1) ulps of ``reduce`` (applied to
    sum|microbatch grads|/W by the caller, plus the same k times the one-ulp
    sensitivity in ``compute``)."""
    k = 2 * (world + 1) + 2 * (microbatches - 1)
    acc = f", each the sum of {microbatches} microbatch grads added in {reduce}" if microbatches > 1 else ""
    eta = max(UNDERFLOW[compute], UNDERFLOW[reduce])
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[reduce], "eta": eta,
            "why": f"mixed precision: per-rank grads in {compute}{acc}, averaged over {world} ranks in {reduce}: "
                   f"{k} ulps of {reduce} of sum|grads|/W, plus {k} x the one-ulp sensitivity in {compute}, "
                   f"plus {k} x {eta:.2g} (a rounding that underflows: half the subnormal spacing)"}


def compare(quantity: str, step: int, fqn: str, got, want, tol: dict, sens: float = 0.0, extra=None) -> dict | None:
    """None when ``got`` matches ``want`` within ``tol``, else a mismatch record.
    ``atol = k*u*max|want| + k*(sens + eta)``, ``eta`` the error of a rounding
    that underflows (``tol``'s, where it counts: float16), ``sens`` being the measured change of
    this tensor under one-ulp nudges of every input (0 for the step oracle);
    ``extra`` is an elementwise allowance (a Partial grad's reduction error)."""
    if got is None or want is None:
        if got is None and want is None:
            return None
        return _mismatch(quantity, step, fqn, tol, detail=f"sharded has {_desc(got)}, reference has {_desc(want)}",
                         presence="appeared" if want is None else "vanished")
    if tuple(got.shape) != tuple(want.shape):
        return _mismatch(
            quantity, step, fqn, tol, detail=f"shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
        )
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.numel() == 0:
        return None
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return _mismatch(quantity, step, fqn, tol, detail="NaN in one run only")
    g, w = g.masked_fill(nan_g, 0), w.masked_fill(nan_w, 0)
    inf = torch.isinf(g) | torch.isinf(w)
    if inf.any() and not torch.equal(g[inf], w[inf]):
        return _mismatch(quantity, step, fqn, tol, detail="inf in one run only")
    g, w = g.masked_fill(inf, 0), w.masked_fill(inf, 0)
    k_u = tol["k_ulps"] * tol["u"]
    atol = k_u * w.abs().max().item() + tol["k_ulps"] * (sens + tol.get("eta", 0.0))
    err = (g - w).abs()
    bound = atol + k_u * w.abs()
    if extra is not None:
        bound = bound + extra.detach().to("cpu", torch.float64).nan_to_num(posinf=float("inf"))
    bad = err > bound
    if not bad.any():
        return None
    flat = int(torch.argmax(torch.where(bad, err - bound, torch.zeros_like(err))).item())
    idx = list(torch.unravel_index(torch.tensor(flat), tuple(w.shape))) if w.dim() else []
    at = tuple(int(i) for i in idx)
    e, ref = err.reshape(-1)[flat].item(), w.reshape(-1)[flat].item()
    return _mismatch(
        quantity,
        step,
        fqn,
        tol,
        max_abs=err.max().item(),
        max_rel=(err / w.abs().clamp_min(1e-300)).max().item(),
        at=at,
        got=g.reshape(-1)[flat].item(),
        want=ref,
        allowed=atol + k_u * abs(ref),
        bad=int(bad.sum().item()),
        numel=w.numel(),
        detail=f"|{e:.3g}| > {atol + k_u * abs(ref):.3g} at {at}",
    )


def compare_hparams(step: int, got: list[dict], want: list[dict]) -> dict | None:
    """Param-group hyperparameters must be equal exactly (they are not computed)."""
    if len(got) != len(want):
        return _mismatch("param_groups", step, "", None, detail=f"{len(got)} groups vs {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        for key in sorted(set(g) | set(w)):
            if not _same(g.get(key), w.get(key)):
                return _mismatch(
                    f"param_groups.{key}", step, f"group {i}", None, detail=f"{g.get(key)!r} vs reference {w.get(key)!r}"
                )
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _desc(t) -> str:
    return "none" if t is None else f"a tensor of shape {tuple(t.shape)}"


def _mismatch(quantity, step, fqn, tol, detail: str, **fields) -> dict:
    tolerance = {"tolerance": tol["why"]} if tol is not None else {}
    return Mismatch(quantity, fqn, step, detail, extra={**tolerance, **fields}).to_dict()


# The replica oracle (kernel/gather.py's replica_mismatches): every rank's copy
# of a replicated value against the lowest rank's. Bit for bit: the ranks hold
# the result of one collective (an all-reduce, a broadcast, an all-gather gives
# every rank the same bits), or of the same deterministic op on the same inputs
# (an optimizer step on replicas of the same params, grads and state; a
# replicated module's backward, on CPU, where every worker runs one thread).
REPLICA_EXACT = {"k_ulps": 0, "u": 0.0,
                 "why": "replicas: bit for bit (a collective gives every rank the same bits, and the same "
                        "deterministic op on the same inputs the same result)"}


def compare_replicas(quantity: str, step: int, fqn: str, copies: dict, tol: dict = REPLICA_EXACT) -> dict | None:
    """None when every rank's copy in ``copies`` ({rank: tensor, None or a
    hyperparameter}) equals the lowest rank's, else one mismatch: the worst
    rank's comparison (``compare``'s numbers, got = that rank's copy, want =
    the lowest rank's), every rank that differs (``ranks``) and the ranks that
    hold each distinct copy (``replicas``). NaN equals NaN; -0.0 equals 0.0."""
    ranks = sorted(copies)
    base = ranks[0]
    want = copies[base]
    worst, worst_rank, differ = None, None, []
    for r in ranks[1:]:
        got = copies[r]
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor) or want is None or got is None:
            m = compare(quantity, step, fqn, got, want, tol)
        else:
            m = None if _same(got, want) else _mismatch(quantity, step, fqn, tol, detail=f"{got!r} vs {want!r}")
        if m is None:
            continue
        differ.append(r)
        size = lambda x: x.get("max_abs", math.inf)  # noqa: E731 (a presence, shape or value: the most telling)
        if worst is None or size(m) > size(worst):
            worst, worst_rank = m, r
    if worst is None:
        return None
    classes: list[list[int]] = []  # ranks holding one copy each, the lowest rank's first
    for r in ranks:
        for cls in classes:
            if _same_copy(copies[cls[0]], copies[r]):
                cls.append(r)
                break
        else:
            classes.append([r])
    worst["detail"] = f"rank {worst_rank}'s copy vs rank {base}'s: {worst['detail']}"
    worst.update(rank=worst_rank, base_rank=base, ranks=differ, replicas=classes)
    return worst


def _same_copy(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return compare("", 0, "", a, b, REPLICA_EXACT) is None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return _same(a, b)


# ---- fuzzshard.kernel.gather -----------------------------------------------
"""Full copies of many DTensors in one collective.

An observation after a step needs a full copy of every param, grad and
state tensor: one ``full_tensor()`` each is one all-gather each, and on CPU
the collective's fixed cost is most of it. Inside ``gather_batch()``, a
target's ``full`` hands out an empty tensor of the global shape and files the
local shard; when the block ends, every rank all-gathers the bytes of all its
shards at once and each full tensor is assembled in place. Only pure data
movement is batched (a Shard placement on a 1-D mesh), so a batched copy is
bit for bit what ``full_tensor()`` gives; a replicated tensor needs no
collective, and a Partial (a sum, whose order is the collective's), a
strided shard, a shard off the mesh's device or a 2-D mesh keep
``full_tensor()``. A rank whose shard is not the size or dtype its spec says
(a torch bug this tool exists to see) flags it in the same collective, and
every rank then gathers that one as before.

The replica oracle rides on the same pass: ``batch.watch(observation)`` has
every rank's full copies of that observation (grads, params, optimizer state,
param-group hyperparameters) compared across all the ranks of the job when
the batch ends. Each rank holds its own copy of what is replicated (a
``Replicate`` mesh dim's local tensor, HSDP's replica, FSDP1's and ZeRO's
whole params), and every copy must be the same. A copy assembled from one
all-gather over every rank of the job is the same bytes everywhere by
construction and is left out; of the others each rank digests every value
(a sum and a position-weighted sum of its bytes, its byte count) and sends
five int64 for the whole observation (how many values, a CRC of their names,
the digests summed by place), in the rows of that all-gather where a mesh of
the batch spans the job, else in one small all-gather. Only where those
differ are the per-value digests gathered, and the values that differ whole,
so the report says which ranks differ, where and by how much
(oracles.compare_replicas).
"""

import contextlib
import math
import sys
import zlib

import torch
import torch.distributed as dist


_OPEN_GATHER: list = []  # the open batch, if any (at most one)


@contextlib.contextmanager
def gather_batch(allowed=None):
    """Full copies asked for inside are gathered together when the block
    ends; nobody may read them before. A collective: every rank of the job
    opens and closes it at the same point. ``allowed(t)``: the world's say on
    whether ``t`` may be batched (kernel/mesh.py, ``World.batchable``); by
    default every tensor that is pure data movement is."""
    b = _GatherBatch(allowed)
    _OPEN_GATHER.append(b)
    try:
        yield b
    finally:
        _OPEN_GATHER.pop()
    b.flush()


def full_batched(t: torch.Tensor, fallback) -> torch.Tensor:
    """A full plain copy of DTensor ``t``: an empty tensor filled when the
    open batch ends, where ``t`` can be batched; else ``fallback(t)`` now."""
    b = _OPEN_GATHER[-1] if _OPEN_GATHER else None
    if b is None or not (b.allowed(t) and _gather_batchable(t)):
        return fallback(t)
    return b.add(t, fallback)


def owned_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy the record owns: a batched full copy already is one."""
    b = _OPEN_GATHER[-1] if _OPEN_GATHER else None
    if b is not None and id(t) in b.dests:
        return t
    return t.detach().clone()


def _gather_batchable(t) -> bool:
    """A DTensor sharded on one dim of a 1-D mesh, on the mesh's device: pure data movement."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1 and type(t.placements[0]) is Shard
            and t.device.type == t.device_mesh.device_type)


class _GatherBatch:
    def __init__(self, allowed=None):
        self.allowed = allowed or (lambda t: True)
        self.items = []  # (dtensor, dest, fallback)
        self.dests = set()  # id() of every dest (items keeps them alive): what owned_copy() must not copy
        self.everywhere = set()  # id() of dests assembled from an all-gather over the whole job: the same bits everywhere
        self.watched = []  # (observation, the list its replica mismatches go into)

    def add(self, t, fallback) -> torch.Tensor:
        dest = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        self.items.append((t, dest, fallback))
        self.dests.add(id(dest))
        return dest

    def flush(self) -> None:
        by_mesh: dict = {}  # in first-seen order: the same on every rank
        for item in self.items:
            by_mesh.setdefault(item[0].device_mesh, []).append(item)
        # a mesh over every rank of the job (the default group is the job's: mesh.Meshes.job) gives the same
        # bits everywhere, and its all-gather carries the replica summaries: no collective of their own
        spans = [m for m in by_mesh if m.size() == dist.get_world_size()]
        compared = bool(self.watched) and dist.get_world_size() > 1  # one rank holds the only copy
        carrier = spans[-1] if spans and compared else None
        for mesh in spans:
            self.everywhere.update(id(dest) for _, dest, _ in by_mesh[mesh])
        for mesh, items in by_mesh.items():
            if mesh is not carrier:
                _gather_shards(mesh, items)
        if not compared:
            return
        prepared = [_replica_digests(obs, self.everywhere) for obs, _ in self.watched]  # every copy filled by now
        summaries = torch.cat([p[2] for p in prepared])
        if carrier is not None:
            table = _gather_shards(carrier, by_mesh[carrier], extra=summaries)
        else:
            table = _all_gather_int64(summaries, None)
        for (_, out), (values, digests, _), seen in zip(self.watched, prepared, table.split(SUMMARY_WORDS, dim=1)):
            out.extend(_replica_compare(values, digests, seen, None))

    def watch(self, observation: dict) -> list:
        """Compare every rank's copies in ``observation`` when the batch ends;
        returns the list the mismatches go into (filled on the lowest rank only)."""
        out: list = []
        self.watched.append((observation, out))
        return out


GATHER_ALIGN = 16  # every shard's bytes start at a multiple of this: a uint8 slice views as any dtype


def _gather_aligned(nbytes: int) -> int:
    return -(-nbytes // GATHER_ALIGN) * GATHER_ALIGN


def _gather_shards(mesh, items: list, extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every shard of ``items`` from every rank of the 1-D ``mesh``, in one
    all-gather of bytes; each rank then assembles every full tensor. ``extra``
    (int64) rides in the same rows: returned as [ranks, len(extra)], every
    rank's, in the mesh's group rank order."""
    group, n, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    plans = []  # per item: its shard dim and, per coordinate, (offset, length) along it and bytes
    for t, _, _ in items:
        d = t.placements[0].dim
        row_bytes = t.element_size() * math.prod(t.shape[:d]) * math.prod(t.shape[d + 1:])
        shards = [shard_size_and_offset(t.shape[d], n, c) for c in range(n)]
        plans.append((d, [(offset, length, length * row_bytes) for length, offset in shards]))
    # a row: a flag per item (1: this rank's shard is not what its spec says), ``extra``, then every shard's bytes
    flags = _gather_aligned(len(items))
    extra_bytes = extra.numel() * 8 if extra is not None else 0
    head = flags + _gather_aligned(extra_bytes)
    width = head + max(sum(_gather_aligned(per[c][2]) for _, per in plans) for c in range(n))
    row = torch.zeros(width, dtype=torch.uint8, device=items[0][1].device)
    if extra_bytes:
        row[flags:flags + extra_bytes] = extra.to(row.device).view(torch.uint8)
    at = head
    for i, ((t, _, _), (d, per)) in enumerate(zip(items, plans)):
        local, nbytes = t.to_local(), per[me][2]
        if local.dtype != t.dtype or local.numel() * local.element_size() != nbytes:
            row[i] = 1
        elif nbytes:
            row[at:at + nbytes] = local.detach().contiguous().view(-1).view(torch.uint8)
        at += _gather_aligned(nbytes)
    table = torch.empty(n * width, dtype=torch.uint8, device=row.device)
    dist.all_gather_into_tensor(table, row, group=group)
    table = table.view(n, width)
    rows = [dist.get_group_rank(group, int(r)) for r in mesh.mesh.tolist()]  # coordinate -> its row
    bad = table[:, :len(items)].any(dim=0).tolist()
    starts = [head] * n
    for i, ((t, dest, fallback), (d, per)) in enumerate(zip(items, plans)):
        for c in range(n):
            offset, length, nbytes = per[c]
            if not bad[i] and nbytes:
                shape = list(t.shape)
                shape[d] = length
                src = table[rows[c], starts[c]:starts[c] + nbytes].view(t.dtype).view(shape)
                dest.narrow(d, offset, length).copy_(src)
            starts[c] += _gather_aligned(nbytes)
        if bad[i]:  # as without the batch: its own full_tensor(), on every rank, in item order
            got = fallback(t)
            dest.resize_(got.shape).copy_(got)
    if extra_bytes:
        return table[:, flags:flags + extra_bytes].contiguous().view(torch.int64).cpu()
    return None


# ---- the replica oracle: every rank's copy of a value, compared ----------

def observed_values(observation: dict) -> list[tuple[str, str, object]]:
    """(quantity, fqn, value) of every replicated value an observation holds,
    in an order every rank shares: grads, params, optimizer state tensors,
    param-group hyperparameters (the names the parity oracle gives them)."""
    out = []
    for fqn, g in sorted((observation.get("grads") or {}).items()):
        out.append(("grad", fqn, g))
    for fqn, p in sorted((observation.get("params") or {}).items()):
        out.append(("param", fqn, p))
    for fqn, st in sorted((observation.get("state") or {}).items()):
        out += [(f"state.{k}", fqn, v) for k, v in sorted(st.items())]
    for i, group in enumerate(observation.get("groups") or []):
        out += [(f"param_groups.{k}", f"group {i}", v) for k, v in sorted(group.items())]
    # the training loop's (kernel/loop.py): the total grad norm, the grad scaler's scale, the scheduler's lrs
    for fqn, v in sorted((observation.get("clip_norm") or {}).items()):
        out.append(("clip_norm", fqn, v))
    for key, v in sorted((observation.get("loop") or {}).items()):
        out.append((f"loop.{key}", "", v))
    return out


def replica_mismatches(observation: dict, skip=frozenset(), group=None) -> list[dict]:
    """Every rank's copy of every value in ``observation`` against the lowest
    rank's: a collective over ``group`` (the job's default group), every rank
    with the same values in the same order. Mismatch records on the lowest
    rank (oracles.compare_replicas), [] elsewhere. ``skip``: id() of tensors
    known to be the same bits on every rank. (Inside ``gather_batch``,
    ``watch`` does this in the batch's own all-gather.)"""
    values, digests, summary = _replica_digests(observation, skip)
    return _replica_compare(values, digests, _all_gather_int64(summary, group), group)


def _replica_digests(observation: dict, skip) -> tuple:
    """(values, their digests, the observation's summary) on this rank."""
    values = [v for v in observed_values(observation) if id(v[2]) not in skip]
    digests = _digests([v for _, _, v in values])
    return values, digests, summary_digest([f"{q} {f} {_kind(v)}" for q, f, v in values], digests)


def _all_gather_int64(x: torch.Tensor, group) -> torch.Tensor:
    """[ranks, len(x)]: every rank's ``x``."""
    n = dist.get_world_size(group)
    table = torch.empty(n * x.numel(), dtype=torch.int64, device=_comm_device(group))
    dist.all_gather_into_tensor(table, x.to(table.device), group=group)
    return table.view(n, -1).cpu()


def _replica_compare(values: list, digests: torch.Tensor, summaries: torch.Tensor, group) -> list[dict]:
    """Where every rank's summary is this one's, nothing; else (rare) every
    rank's names and digests, then only the values that differ, whole."""
    n = dist.get_world_size(group)
    if n == 1 or bool((summaries == summaries[0]).all()):
        return []
    every = _all_gather_objects([((q, f), (_kind(v), d)) for (q, f, v), d in zip(values, digests.tolist())], group)
    keys = sorted({k for held in every for k, _ in held}, key=lambda k: (k[0] != "grad", k))
    held = [dict(h) for h in every]
    differ = [k for k in keys if any(h.get(k) != held[0].get(k) for h in held)]
    mine = {(q, f): v for q, f, v in values}
    copies = _all_gather_objects([_portable(mine.get(k)) for k in differ], group)
    return _compared(group, differ, copies)


def _all_gather_objects(obj, group) -> list:
    """Every rank's ``obj``, in group rank order (``dist.all_gather_object``).
    Under LocalTensorMode (``--simulate``: every rank of the job in this
    process) each rank's ``obj`` is here already, its LocalTensors and per-rank
    ints (a LocalTensor's ``tolist()``) holding every rank's own: rank r's
    ``obj`` is that with rank r's, as a real rank would have sent it."""
    lt = sys.modules.get("torch.distributed._local_tensor")  # never imported: no LocalTensorMode
    mode = lt.enabled_local_tensor_mode() if lt is not None else None
    if mode is None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, obj, group=group)
        return every
    ranks = dist.get_process_group_ranks(group) if group is not None else sorted(mode.ranks)
    with mode.disable():  # what each rank holds: plain tensors, as a real rank's
        return [_on_rank(obj, r, lt.LocalTensor) for r in ranks]


def _on_rank(x, r: int, local_tensor: type):
    """``x`` as simulated rank ``r`` holds it: each LocalTensor its tensor on ``r``, each per-rank int its int."""
    if isinstance(x, local_tensor):
        return x._local_tensors[r]
    if isinstance(x, torch.SymInt):
        ints = getattr(x.node, "_local_ints", None)  # a LocalIntNode; a ConstantIntNode is one int for all
        return ints[r] if ints is not None else x.node.maybe_as_int()
    if isinstance(x, (list, tuple)):
        return type(x)(_on_rank(v, r, local_tensor) for v in x)
    if isinstance(x, dict):
        return {k: _on_rank(v, r, local_tensor) for k, v in x.items()}
    return x


SUMMARY_WORDS = 5  # int64 an observation's summary takes


def summary_digest(names: list[str], digests: torch.Tensor) -> torch.Tensor:
    """Five int64 for a whole observation, the same length on every rank: how
    many values, the CRC of their names and kinds (a rank holding other values
    has diverged too), and their digests summed, each weighted by its place
    (one value that changes changes the sum)."""
    weights = torch.arange(1, 2 * len(names) + 1, 2, dtype=torch.int64).unsqueeze(1)
    total = (digests * weights).sum(0) if len(names) else torch.zeros(DIGEST_WORDS, dtype=torch.int64)
    head = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64)
    return torch.cat([head, total])


def _compared(group, keys: list, every: list) -> list[dict]:
    """On the lowest rank: compare_replicas of each (quantity, fqn) in ``keys``,
    ``every[r][j]`` rank r's copy of the j-th."""
    if dist.get_rank(group) != 0:
        return []
    out = []
    for j, (quantity, fqn) in enumerate(keys):
        m = compare_replicas(quantity, -1, fqn, {r: copies[j] for r, copies in enumerate(every)})
        if m is not None:
            out.append(m)
    return out


def _kind(v) -> str:
    """What a value is, for the names every rank must share (not its contents)."""
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{tuple(v.shape)}"
    return "none" if v is None else type(v).__name__


def _comm_device(group) -> torch.device:
    """Where the group's collectives take tensors: NCCL's on this rank's GPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _portable(v):
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


DIGEST_WORDS = 3  # per value: sum of its bytes, their position-weighted sum, its byte count


def _digests(values: list) -> torch.Tensor:
    """[len(values), 3] int64: a tensor's bytes summed plainly and weighted by
    their position (a drift, a swap or a scale changes one of them; equal
    bytes give equal digests), its byte count; a None, -1s; anything else (a
    hyperparameter) the CRC of its repr. Tensors are digested together per
    device: their bytes in one cat, then two index_adds."""
    out = torch.zeros(len(values), DIGEST_WORDS, dtype=torch.int64)
    by_device: dict = {}
    for i, v in enumerate(values):
        if v is None:
            out[i] = -1
        elif isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i, 0] = zlib.crc32(repr(v).encode())
    for device, idx in by_device.items():
        raw = [values[i].detach().contiguous().view(-1).view(torch.uint8) for i in idx]
        counts = torch.tensor([r.numel() for r in raw], device=device)
        flat = torch.cat(raw).to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(idx), device=device), counts)
        pos = torch.arange(flat.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[seg]
        sums = torch.zeros(2, len(idx), dtype=torch.int64, device=device)
        sums[0].index_add_(0, seg, flat)
        sums[1].index_add_(0, seg, flat * (pos % 65521 + 1))  # below 2^24 a byte: no overflow under 2^39 bytes
        out[idx, :2] = sums.t().cpu()
        out[idx, 2] = counts.cpu()
    return out


# ---- fuzzshard.kernel.decoder ----------------------------------------------
"""The built-in decoder transformer: the model people shard with FSDP2 and TP.

Token embedding, ``n_layers`` pre-norm residual blocks of [norm -> self-
attention through ``F.scaled_dot_product_attention`` (causal or not, rotary
position embeddings on q and k, grouped-query: ``n_kv_heads`` divides
``n_heads``) -> residual, norm -> MLP (SwiGLU: w1, w3, w2; or GELU: w1, w2)
-> residual], a final norm and an output head over the vocabulary (tied to
the embedding or not). The module names are torchtitan's Llama's, so a TP
plan reads as torchtitan's does. Trained with cross-entropy on token targets
(model.loss_fn).

The Case holds it as ``Model(factory="decoder", sizes={...})``; its sizes
are drawn in strategies/decoders.py. Everything here is plain torch: under
TP each rank sees its own heads (views with -1 heads), as torchtitan's do.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over [B, L, H, D]: the first 2*(D//2) features
    rotate in pairs (i, i + D//2); an odd last feature stays."""
    B, L, H, D = x.shape
    half = D // 2
    if half == 0:
        return x
    pos = torch.arange(L, dtype=x.dtype, device=x.device)[:, None]
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angle = (pos * freqs)[None, :, None, :]  # [1, L, 1, half]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, causal: bool):
        super().__init__()
        self.head_dim, self.n_rep, self.causal = head_dim, n_heads // n_kv_heads, causal
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (w(x).view(B, L, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        # grouped-query: each KV head serves n_rep query heads (Llama's repeat_kv)
        k, v = (t.repeat_interleave(self.n_rep, dim=2) if self.n_rep > 1 else t for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, swiglu: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        if swiglu:
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(x) if hasattr(self, "w3") else F.gelu(self.w1(x))
        return self.w2(h)


def _norm(kind: str, dim: int) -> nn.Module:
    return nn.RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim)


class Block(nn.Module):
    def __init__(self, sizes: dict):
        super().__init__()
        dim = sizes["n_heads"] * sizes["head_dim"]
        self.attention_norm = _norm(sizes["norm"], dim)
        self.attention = Attention(dim, sizes["n_heads"], sizes["n_kv_heads"], sizes["head_dim"], sizes["causal"])
        self.ffn_norm = _norm(sizes["norm"], dim)
        self.feed_forward = FeedForward(dim, sizes["hidden"], sizes["mlp"] == "swiglu")

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, sizes: dict):
        super().__init__()
        dim = sizes["n_heads"] * sizes["head_dim"]
        self.tok_embeddings = nn.Embedding(sizes["d_in"], dim)
        self.layers = nn.ModuleDict({str(i): Block(sizes) for i in range(sizes["n_layers"])})
        self.norm = _norm(sizes["norm"], dim)
        self.output = nn.Linear(dim, sizes["d_in"], bias=False)
        if sizes["tied"]:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two modules

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


# the keys of a decoder's sizes, and what each is
DECODER_SIZES = {
    "d_in": "the vocabulary",
    "n_layers": "blocks",
    "n_heads": "query heads (the model dim is n_heads * head_dim)",
    "n_kv_heads": "key/value heads (divides n_heads: grouped-query attention)",
    "head_dim": "features per head",
    "hidden": "the MLP's hidden width",
    "mlp": '"swiglu" (w1, w3, w2) or "gelu" (w1, w2)',
    "norm": '"rms" (nn.RMSNorm) or "layer" (nn.LayerNorm)',
    "causal": "causal attention",
    "tied": "the output head shares the embedding's weight",
}


def decoder(**sizes) -> Decoder:
    missing = sorted(set(DECODER_SIZES) - set(sizes))
    if missing:
        raise ValueError(f"decoder sizes lack {missing}")
    return Decoder(sizes)


# TP plan elements, torchtitan's: module FQN -> style (fsdp2's "tp" option for a decoder)
TP_STYLES = {
    "rowwise": "the embedding, row-wise (vocabulary-sharded), its output replicated or sequence-sharded",
    "heads": "attention: wq/wk/wv column-wise (each rank its own query and KV heads), wo row-wise",
    "mlp": "MLP: w1 (and w3) column-wise, w2 row-wise",
    "colwise": "the output head, column-wise (vocabulary-sharded logits, gathered unless loss_parallel)",
}


def plan_element(fqn: str) -> bool:
    """A TP plan's unit, by plain FQN: the embedding, a block's norms, attention
    and MLP, the final norm, the head (what localizing traces under TP)."""
    parts = fqn.split(".")
    if len(parts) == 1:
        return fqn in ("tok_embeddings", "norm", "output")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in ("attention_norm", "attention", "ffn_norm",
                                                                    "feed_forward")


def parallelize_decoder(model: Decoder, tp_mesh, plan: dict, sp: bool = False, loss_parallel: bool = False) -> None:
    """Tensor parallelism on ``tp_mesh`` as torchtitan's ``apply_tp`` does it,
    for the plan's elements (``TP_STYLES``). Between blocks the activation is
    replicated, or with ``sp`` (sequence parallelism) sharded on the sequence
    dim: the norms ``SequenceParallel``, a ``PrepareModuleInput`` gathering the
    sequence in front of a sharded attention or MLP, and around an element left
    whole a ``PrepareModuleInputOutput`` that gathers its input and scatters its
    output again. ``loss_parallel``: the logits stay vocabulary-sharded DTensors
    for ``torch.distributed.tensor.parallel.loss_parallel``'s cross-entropy."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    between = Shard(1) if sp else Replicate()

    def whole():  # an element left unsharded, under SP: the full sequence in, this rank's part out
        return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True)

    top = {}
    if "tok_embeddings" in plan:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    elif sp:  # a replicated embedding: its output scattered over the sequence
        top["tok_embeddings"] = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    if sp:
        top["norm"] = SequenceParallel()
    if "output" in plan:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    elif sp:  # a replicated head: the final norm's sequence shards gathered into it
        top["output"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    for name, block in model.layers.items():
        inner = {}
        for part, style, col, row in (("attention", "heads", ("wq", "wk", "wv"), "wo"),
                                      ("feed_forward", "mlp", ("w1", "w3"), "w2")):
            if plan.get(f"layers.{name}.{part}") != style:
                if sp:
                    inner[part] = whole()
                continue
            if sp:
                inner[part] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for w in col:
                if hasattr(block.get_submodule(part), w):
                    inner[f"{part}.{w}"] = ColwiseParallel()
            inner[f"{part}.{row}"] = RowwiseParallel(output_layouts=between)
        if sp:
            inner["attention_norm"] = SequenceParallel()
            inner["ffn_norm"] = SequenceParallel()
        if inner:
            parallelize_module(block, tp_mesh, inner)


# ---- fuzzshard.kernel.model ------------------------------------------------
"""Build a model from a Case's ``Model`` spec, deterministically from a seed:
a drawn topology (``layers``), the built-in decoder transformer
(``factory="decoder"``, decoder.py), or a plugin's model (``factory``: a
function registered with ``fuzzshard.plugin.model``, called with the drawn
sizes)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


# modules torch puts between a module and its children (FSDP1's unit, the
# activation-checkpoint wrapper); FQNs leave them out, as DSD's state dicts do
WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def plain_fqn(name: str) -> str:
    """A name in a wrapped model as the plain model has it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """{plain FQN: param}, whatever wrappers the target put in between."""
    return {plain_fqn(n): p for n, p in model.named_parameters()}


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The module at a plain FQN; a wrapper on the way answers for the module it
    wraps (the outermost one: what fully_shard of that FQN should take)."""
    mod = model
    for part in fqn.split(".") if fqn else ():
        while part not in mod._modules and any(w in mod._modules for w in WRAPPERS):
            mod = next(mod._modules[w] for w in WRAPPERS if w in mod._modules)
        mod = mod.get_submodule(part)
    return mod


# a plugin's models: name -> build(**sizes) -> nn.Module taking [B, L, d_in] floats
# (or [B, L] token ids below d_in) and giving [B, L, d_out]
USER_MODELS: dict = {}
# fuzzshard's own factories: trained on token targets with cross-entropy (loss_fn)
BUILTIN_MODELS = {"decoder": decoder}


def token_targets(spec: Model) -> bool:
    """Whether the model is trained on token targets (cross-entropy), not on drawn floats (mean squared error)."""
    return spec.factory in BUILTIN_MODELS


def tied_modules(spec: Model) -> tuple[str, ...]:
    """The modules that own a tied param (a target keeps them whole, or in the root's unit)."""
    if spec.factory == "decoder":
        return ("output", "tok_embeddings") if spec.sizes.get("tied") else ()
    return ("layers.0",) if spec.tie_head else ()


def _user_model(spec: Model) -> nn.Module:
    if spec.factory in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec.factory](**spec.sizes)
    if spec.factory not in USER_MODELS:
        raise ValueError(f"model {spec.factory!r} is a plugin's: pass its file (--plugin / --setup)")
    return USER_MODELS[spec.factory](**spec.sizes)


_META: dict = {}


def _meta(spec: Model) -> tuple[dict, int]:
    """(param shapes, output width) of a plugin's model, built and run on the
    meta device: no memory, no compute, no RNG drawn."""
    import json

    key = (spec.factory, json.dumps(spec.sizes, sort_keys=True), spec.input, spec.d_in)
    if key not in _META:
        with torch.device("meta"):
            m = _user_model(spec)
            x = torch.zeros(1, 1, dtype=torch.long) if spec.input == "tokens" else torch.zeros(1, 1, spec.d_in)
            out = m(x)
        _META[key] = ({n: tuple(p.shape) for n, p in m.named_parameters()}, out.shape[-1])
    return _META[key]


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}


class Act(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ACTIVATIONS[self.name](x)


class Conv(nn.Module):
    """Conv1d over the sequence axis of a [B, L, D] activation."""

    def __init__(self, d_in: int, d_out: int, kernel: int, bias: bool):
        super().__init__()
        self.conv = nn.Conv1d(d_in, d_out, kernel, padding=kernel // 2, bias=bias)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Twice(nn.Module):
    """One submodule called twice in one forward: its params get two grad contributions."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(self.inner(x))


class Net(nn.Module):
    def __init__(self, spec: Model):
        super().__init__()
        self.layers = nn.ModuleList(_build(layer) for layer in spec.layers)
        d_last = out_dim(spec)
        if spec.tie_head:
            emb = self.layers[0]
            self.head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
            self.head.weight = emb.weight  # tied: one Parameter registered twice
        if spec.unused:
            self.unused = nn.Linear(2, 3)  # never called: its grads stay None
        if spec.buffer:
            self.register_buffer("scale", torch.rand(d_last) + 0.5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if hasattr(self, "head"):
            x = self.head(x)
        if hasattr(self, "scale"):
            x = x * self.scale
        return x


def _build(layer: Layer) -> nn.Module:
    k = layer.kind
    if k == "linear":
        return nn.Linear(layer.d_in, layer.d_out, bias=layer.bias)
    if k == "embedding":
        return nn.Embedding(layer.d_in, layer.d_out)
    if k == "layernorm":
        return nn.LayerNorm(layer.d_in, bias=layer.bias)
    if k == "conv1d":
        return Conv(layer.d_in, layer.d_out, layer.kernel, layer.bias)
    if k == "act":
        return Act(layer.act)
    if k == "seq":
        return nn.Sequential(*[_build(c) for c in layer.children])
    if k == "residual":
        return Residual(nn.Sequential(*[_build(c) for c in layer.children]))
    if k == "twice":
        return Twice(nn.Sequential(*[_build(c) for c in layer.children]))
    raise ValueError(f"unknown layer kind {k!r}")


def build_model(spec: Model, seed: int, device: str, dtype: torch.dtype) -> nn.Module:
    """The same seed gives bitwise the same initial model on every rank."""
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone, what fork_rng restores: torch.manual_seed would seed CUDA's too, which on
        # a machine without CUDA queues the call with a formatted stack each time (a third of a millisecond)
        torch.random.default_generator.manual_seed(seed)
        net = _user_model(spec) if spec.factory else Net(spec)
    return net.to(device=device, dtype=dtype)


def out_dim(spec: Model) -> int:
    if spec.factory:
        return _meta(spec)[1]
    if spec.tie_head:
        return spec.d_in  # the head maps back to the vocabulary
    d = spec.d_in
    for layer in spec.layers:
        d = _out(layer, d)
    return d


def _out(layer: Layer, d: int) -> int:
    if layer.kind in ("linear", "embedding", "conv1d"):
        return layer.d_out
    if layer.kind == "seq":
        for c in layer.children:
            d = _out(c, d)
    return d


def param_shapes(spec: Model) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of every unique parameter, in ``named_parameters()`` order,
    without building anything (strategies draw groups and placements from it)."""
    if spec.factory:
        return dict(_meta(spec)[0])
    shapes: dict[str, tuple[int, ...]] = {}
    for i, layer in enumerate(spec.layers):
        _shapes(layer, f"layers.{i}", shapes)
    if spec.unused:
        shapes["unused.weight"] = (3, 2)
        shapes["unused.bias"] = (3,)
    return shapes


def _shapes(layer: Layer, prefix: str, out: dict) -> None:
    k = layer.kind
    if k == "linear":
        out[f"{prefix}.weight"] = (layer.d_out, layer.d_in)
        if layer.bias:
            out[f"{prefix}.bias"] = (layer.d_out,)
    elif k == "embedding":
        out[f"{prefix}.weight"] = (layer.d_in, layer.d_out)
    elif k == "layernorm":
        out[f"{prefix}.weight"] = (layer.d_in,)
        if layer.bias:
            out[f"{prefix}.bias"] = (layer.d_in,)
    elif k == "conv1d":
        out[f"{prefix}.conv.weight"] = (layer.d_out, layer.d_in, layer.kernel)
        if layer.bias:
            out[f"{prefix}.conv.bias"] = (layer.d_out,)
    elif k == "seq":
        for j, c in enumerate(layer.children):
            _shapes(c, f"{prefix}.{j}", out)
    elif k in ("residual", "twice"):
        for j, c in enumerate(layer.children):
            _shapes(c, f"{prefix}.inner.{j}", out)


def make_batch(spec: Model, seed: int, step: int, batch: int, seq: int, device: str, dtype: torch.dtype):
    """Global (inputs, targets) of one step; every rank draws the same."""
    g = torch.Generator().manual_seed(seed * 1000 + step + 1)
    if spec.input == "tokens":
        x = torch.randint(0, spec.d_in, (batch, seq), generator=g)
    else:
        x = torch.randn(batch, seq, spec.d_in, generator=g).to(dtype)
    if token_targets(spec):  # the next tokens, as drawn: any of the vocabulary
        y = torch.randint(0, out_dim(spec), (batch, seq), generator=g)
    else:
        y = torch.randn(batch, seq, out_dim(spec), generator=g).to(dtype)
    return x.to(device), y.to(device)


def loss_fn(out, target):
    """Cross-entropy over the vocabulary for token targets, else mean squared error; a mean over all positions."""
    if not target.is_floating_point():
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))
    return ((out - target) ** 2).mean()


# ---- fuzzshard.kernel.state_io ---------------------------------------------
"""State-dict I/O: save a sharded model and optimizer mid-schedule and load
them into a fresh pair, through torch's own APIs (``get_state_dict`` /
``set_state_dict``, ``torch.save`` of the full dict, ``dcp.save`` /
``dcp.load`` with the file-system writer and reader) into a real directory.
What must survive the round trip is checkpoint.py's (the oracles); a target
that saves its own way (fsdp1, zero, sharded_optim) overrides Target.save and
Target.load and may reuse these.

A DCP save may be ``dcp.async_save`` (``Checkpoint.async_save``, ``dcp_save``):
training goes on while it runs, so right after the call returns (after its
staging future, where it returns one: torchtitan's ``maybe_wait_for_staging``
before the next optimizer step) every tensor the saved state dict holds is
changed in place, as a step would, until the upload is done; then the values
are put back. What loads must be the state at the call (checkpoint.py's
*loaded* oracle): a copy taken after the call returned shows there.
"""

import atexit
import os
import threading

import torch
import torch.distributed as dist


FULL_FILE = "full.pt"
# the round trips through torch.distributed.checkpoint's state-dict API (set_state_dict: split and strict
# apply), in draw order, each with how it saves and loads
STATE_DICT_KINDS = {"full": "full state dict, torch.save on rank 0, torch.load on every rank",
                    "dcp": "sharded state dict through torch.distributed.checkpoint",
                    "broadcast": "full state dict, read by rank 0, set_state_dict(broadcast_from_rank0=True)"}


def save(case: Case, model, opt, path: str, group) -> dict | None:
    """Collective over the saving job; rank 0 returns what it saved (full kinds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if case.checkpoint.kind == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp_save(case, {"model": msd, "optim": osd}, os.path.join(path, "dcp"), group)
        return None
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    torch.save({"model": msd, "optim": osd}, os.path.join(path, FULL_FILE))
    return {"model": msd, "optim": osd}


def load(case: Case, model, opt, path: str, group) -> None:
    """Collective over the loading job: the checkpoint into a fresh model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict, set_state_dict)

    ck = case.checkpoint
    missing = keys_of(model, ck.missing)
    if ck.kind == "dcp":
        msd, osd = get_state_dict(model, opt)  # the sharded layout to load into
        # dcp.load fills the model's own tensors in place: a missing key is one it is not asked for
        sd = {"model": without(msd, missing), "optim": osd}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), process_group=group)
        msd, osd = sd["model"], sd["optim"]
        options = StateDictOptions(strict=ck.strict)
    else:
        broadcast = ck.kind == "broadcast"
        msd, osd = {}, {}
        if not broadcast or dist.get_rank() == 0:
            saved = torch.load(os.path.join(path, FULL_FILE))
            msd, osd = saved["model"], saved["optim"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=ck.strict)
    if msd:  # (not on a broadcast rank that holds nothing)
        msd = without(msd, missing)
        if ck.unexpected:
            msd[UNEXPECTED_KEY] = torch.zeros(2)
    if ck.split:
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
    else:
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


UNEXPECTED_KEY = "fuzzshard_unexpected.weight"


def keys_of(model, fqns) -> set[str]:
    """Every state-dict key of these params: a tied param has one per module
    holding it, and is missing only when all of them are."""
    if not fqns:
        return set()
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_fqn(n))
    return set(fqns) | {k for keys in names.values() if set(keys) & set(fqns) for k in keys}  # (flat params: by name)


def without(msd: dict, keys: set[str]) -> dict:
    """A copy of the state dict without ``keys`` (a copy: DSD rewrites the dict it loads)."""
    return {k: v for k, v in msd.items() if k not in keys}


def as_tensor(v):
    """A state value as a tensor (a step may be a Python number)."""
    return v if v is None or isinstance(v, torch.Tensor) else torch.tensor(v)


# ---- async saves ----------------------------------------------------------

# Checkpoint.async_save -> how torch.distributed.checkpoint.async_save is called (in draw order; "" a blocking
# dcp.save): the forms torchtitan's async_mode runs, as far as the device allows
ASYNC_SAVES = {
    "thread": "async_save(checkpoint_id=...), the form of torchtitan's async_mode='async' and the recipe: torch "
              "makes its own DefaultStager (a blocking copy to CPU in the call) and uploads on a thread; a Future",
    "writer": "async_save(storage_writer=FileSystemWriter(...)): the writer stages for itself (BlockingAsyncStager, "
              "a blocking copy to CPU in the call), the upload on a thread; a Future",
    "stager": "async_save(async_stager=...) with a DefaultStager the process keeps and reuses (staging on its own "
              "thread): an AsyncSaveResponse, the state changed once its staging is complete",
    "pinned": "as stager, the DefaultStager staging into pinned, shared memory (torchtitan's "
              "async_mode='async_with_pinned_mem' on the thread executor, not its checkpoint process; pinning "
              "needs CUDA: torch ignores it on CPU, with a warning)",
}

# the DefaultStagers kept by this process, one per form and device type, reused by every case's save (as a
# training job keeps one over its saves, torchtitan's CheckpointManager.stager); closed at exit
_STAGERS: dict = {}


def async_save_problem(case: Case) -> str | None:
    """Why the case's async_save cannot run (a CaseError's text), None if it can or is unused."""
    ck = case.checkpoint
    how = ck.async_save if ck else ""
    if not how:
        return None
    if how not in ASYNC_SAVES:
        return f"checkpoint async_save {how!r}: one of {sorted(ASYNC_SAVES)} (or \"\", a blocking save)"
    if ck.kind != "dcp":
        return f"checkpoint async_save {how!r}: async_save is a DCP save, and a {ck.kind!r} checkpoint saves otherwise"
    missing = _missing_api(how)
    if missing:
        return f"checkpoint async_save {how!r}: this torch's torch.distributed.checkpoint has no {missing}"
    if case.device != "cpu":
        # async_save asserts a CPU backend in its process group; the pool's groups on CUDA are NCCL only (torchtitan
        # makes a gloo group for its async saves: a pool started with "cpu:gloo,cuda:nccl" would lift this)
        return (f"checkpoint async_save {how!r} on {case.device}: async_save needs a CPU backend in the process "
                f"group, and the pool's groups there are NCCL only")
    return None


def _missing_api(how: str) -> str:
    """What this torch lacks of what ``how`` calls ("" if nothing)."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "async_save"):
        return "async_save"
    if how in ("stager", "pinned"):
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError:
            return "DefaultStager"
        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            return "async_save(async_stager=...)"
    return ""


def dcp_save(case: Case, state_dict: dict, path: str, group) -> None:
    """``dcp.save`` of ``state_dict`` into ``path``, or ``dcp.async_save`` as the
    case's checkpoint says, training going on (the saved tensors changed in
    place) until the upload is done. Every future is waited for before this
    returns, on errors too: no save thread outlives the case."""
    import torch.distributed.checkpoint as dcp

    how = case.checkpoint.async_save if case.checkpoint else ""
    if not how:
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path), process_group=group)
        return
    stager = _stager(how, case.device) if how in ("stager", "pinned") else None
    try:
        if stager is not None:
            # an earlier save through the same stager, of other values (a loop saving every N steps): staging
            # the checkpoint's state must copy it again, not hand back what the stager holds from before
            with _changed(state_dict) as restore:
                response = dcp.async_save(state_dict, storage_writer=dcp.FileSystemWriter(path + "_earlier"),
                                          process_group=group, async_stager=stager)
                try:
                    _wait_staging(response)
                    restore()  # training goes on: the state of this save's call, restored while it uploads
                finally:
                    _wait_upload(response)  # (torchtitan waits for the last save before the next)
        if how == "thread":  # no writer: torch infers it from the path and stages with its own DefaultStager
            response = dcp.async_save(state_dict, checkpoint_id=path, process_group=group)
        else:
            response = dcp.async_save(state_dict, storage_writer=dcp.FileSystemWriter(path), process_group=group,
                                      **({"async_stager": stager} if stager is not None else {}))
        try:
            _wait_staging(response)
            with _changed(state_dict):  # training goes on while the save runs: the state changes in place
                _wait_upload(response)
        except BaseException:
            _wait_upload(response, quiet=True)
            raise
    except BaseException:
        if stager is not None:  # a stager a failed save went through is not reused: the next case starts anew
            _drop_stager(how, case.device)
        raise
    finally:
        _join_save_threads()


def _stager(how: str, device: str):
    """This process's DefaultStager for ``how`` on ``device``, made on first use."""
    key = (how, torch.device(device).type)
    if key not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # torchtitan's options for "pinned"; a non-blocking copy needs an accelerator (torch asserts one), and
        # without CUDA torch ignores the pinning, with a warning (once: the stager is kept)
        accelerator = key[1] != "cpu" and torch.accelerator.is_available()
        _STAGERS[key] = DefaultStager(StagingOptions(use_pinned_memory=how == "pinned",
                                                     use_shared_memory=how == "pinned", use_async_staging=True,
                                                     use_non_blocking_copy=accelerator))
    return _STAGERS[key]


def _drop_stager(how: str, device: str) -> None:
    stager = _STAGERS.pop((how, torch.device(device).type), None)
    if stager is not None:
        try:
            stager.close()
        except Exception:
            pass


@atexit.register
def close_stagers() -> None:
    """Close every kept stager (its staging thread, its cached copies)."""
    for key in list(_STAGERS):
        _drop_stager(*key)


def _wait_staging(response) -> None:
    """An AsyncSaveResponse's staging future (the state may change once it is done); a Future has none."""
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()


def _wait_upload(response, quiet: bool = False) -> None:
    upload = getattr(response, "upload_completion", response)
    try:
        upload.result()
    except BaseException:
        if not quiet:
            raise


def _join_save_threads(timeout: float = 30.0) -> None:
    """The upload executor's thread shuts itself down once its future is done: let it finish, so no
    save thread is alive when the case ends."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("AsyncCheckpointExecutor"):
            t.join(timeout)


class _changed:
    """Every tensor ``state_dict`` holds, changed in place on this rank (a
    float +1, a bool flipped: what a step does to params and state, here
    never zero), and put back on leaving or when ``restore()`` is called.
    A DTensor's or ShardedTensor's local storage is changed, never through a
    collective; a tensor held twice (tied) is changed once."""

    def __init__(self, state_dict: dict):
        self.live = _local_tensors(state_dict)
        self.before: list | None = None

    def __enter__(self):
        with torch.no_grad():
            self.before = [t.clone() for t in self.live]
            for t in self.live:
                if t.dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.add_(1)
        return self.restore

    def restore(self) -> None:
        if self.before is not None:
            with torch.no_grad():
                for t, b in zip(self.live, self.before):
                    t.copy_(b)
            self.before = None

    def __exit__(self, *exc) -> None:
        self.restore()


def _local_tensors(value, out: list | None = None, seen: set | None = None) -> list:
    """The local tensors (a DTensor's local tensor, a ShardedTensor's local shards) of every tensor in a nested
    state dict, each once, those with elements."""
    out, seen = ([] if out is None else out), (set() if seen is None else seen)
    if isinstance(value, dict):
        for v in value.values():
            _local_tensors(v, out, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _local_tensors(v, out, seen)
    elif isinstance(value, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            tensors = [value._local_tensor]
        elif hasattr(value, "local_shards"):  # a ShardedTensor
            tensors = [s.tensor for s in value.local_shards()]
        else:
            tensors = [value]
        for t in tensors:
            key = (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if t.numel() and key not in seen:
                seen.add(key)
                out.append(t)
    return out


# ---- fuzzshard.kernel.loop -------------------------------------------------
"""The training loop around ``optimizer.step()``, as a user's loop (torchtitan's,
Lightning's) runs it, one step at a time:

    scaler.scale(loss).backward()      # an overflow step: the loss made infinite on purpose
    g[i] = inf                         # or a partial one: an element of a grad, where a rank holds it
    scaler.unscale_(opt)               # the grads as the plain model's: observed here
    norm = clip_grad_norm_(...)        # the total norm and the clipped grads: observed
    scaler.step(opt); scaler.update()  # skipped when a grad is not finite (found_inf observed); the scale moves
    lr_scheduler.step()                # every group's lr: observed with the hyperparameters

The sharded run (run.py) and the reference (reference.py) each build a Loop
from the case; what differs is the target's hooks (its grad scaler, its own
clipping, the full value of a DTensor norm). A case that draws none of it
runs as before: every method is a no-op then.
"""

import functools
import math
import os

import torch


# what a LambdaLR's lambda is, by name (a Case holds data, not code); torchtitan's warmup is the first
LAMBDAS = ("linear_warmup", "exponential")


def _linear_warmup(warmup: int, step: int) -> float:
    """torchtitan's linear warmup (lr_scheduler.py): a ramp to 1 over ``warmup`` steps."""
    return (step + 1) / (warmup + 1) if step < warmup else 1.0


def _exponential(factor: float, step: int) -> float:
    return factor ** step


def lr_lambda(kwargs: dict):
    """The callable LambdaLR's ``lr_lambda`` names: a partial (not a lambda), so
    ``state_dict`` keeps what it holds, as a user's callable object."""
    if kwargs.get("lambda") == "exponential":
        return functools.partial(_exponential, kwargs.get("factor", 0.9))
    return functools.partial(_linear_warmup, kwargs.get("warmup", 2))


def build_lr_scheduler(opt, spec: LRScheduler):
    """The case's scheduler over ``opt`` (SequentialLR and ChainedScheduler over their children)."""
    from torch.optim import lr_scheduler as sched

    kwargs = dict(spec.kwargs)
    if spec.name == "LambdaLR":
        return sched.LambdaLR(opt, lr_lambda({k: kwargs.pop(k) for k in ("lambda", "warmup", "factor") if k in kwargs}),
                              **kwargs)
    if spec.name == "SequentialLR":
        return sched.SequentialLR(opt, [build_lr_scheduler(opt, c) for c in spec.children], **kwargs)
    if spec.name == "ChainedScheduler":
        return sched.ChainedScheduler([build_lr_scheduler(opt, c) for c in spec.children], optimizer=opt)
    return getattr(sched, spec.name)(opt, **kwargs)


def norm_type(clip: Clip) -> float:
    return math.inf if clip.norm_type == "inf" else float(clip.norm_type)


def clip_grads(params: list, clip: Clip, full=None, own=None):
    """Clip the grads of ``params`` in place as ``clip`` says; the total norm the
    user sees as a full value (``full``: a DTensor norm made whole, as torchtitan
    does with ``full_tensor()``), or None for clip_grad_value_. ``own``: the
    target's own clip_grad_norm_ (FSDP1's), for how "own"."""
    nt = norm_type(clip)
    if clip.how == "value":
        torch.nn.utils.clip_grad_value_(params, clip.max_norm, foreach=clip.foreach)
        return None
    if clip.how == "own" and own is not None:
        norm = own(clip.max_norm, nt)
    elif clip.how == "two_part":
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, nt, clip.error_if_nonfinite, clip.foreach)
        norm = full(norm) if full else norm
        torch.nn.utils.clip_grads_with_norm_(params, clip.max_norm, norm, clip.foreach)
    else:  # "norm"; "own" with no own (the reference: what FSDP1's documents itself as, on the full grads)
        norm = torch.nn.utils.clip_grad_norm_(params, clip.max_norm, nt, clip.error_if_nonfinite, clip.foreach)
    return (full(norm) if full else norm).detach().clone()


class Loop:
    """One run's loop state: the scaler and the LR scheduler, on ``opt``.
    ``scaler``: () -> the grad scaler (the target's: ShardedGradScaler for FSDP),
    ``full``: a norm as a full tensor, ``own``: the target's clip_grad_norm_."""

    def __init__(self, case: Case, opt, scaler=None, full=None, own=None):
        self.case, self.opt, self.full, self.own = case, opt, full, own
        self.scaler = None
        if case.scaler:
            s = case.scaler
            make = scaler or (lambda **kw: torch.amp.GradScaler(case.device, **kw))
            self.scaler = make(init_scale=s.init_scale, growth_factor=s.growth_factor,
                               backoff_factor=s.backoff_factor, growth_interval=s.growth_interval)
        self.lr = build_lr_scheduler(opt, case.lr_scheduler) if case.lr_scheduler else None
        self.found_inf = None  # the last step's found_inf (0 or 1), read between scaler.step and update
        # the sharded run's (run.py sets it): found_inf observed as every rank's of the job, one all_gather, so
        # the reporting rank's record says which rank skipped apart from the reference (one face, whichever rank)
        self.every_rank = False

    def _every(self, value: float):
        import torch.distributed as dist

        if not (self.every_rank and dist.is_initialized()) or dist.get_world_size() == 1:
            return [value]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, value)  # the job's ranks: its default group (meshes.job)
        return every

    @property
    def used(self) -> bool:
        return bool(self.scaler or self.lr or self.case.clip)

    def overflows(self, k: int) -> bool:
        """Whether step ``k``'s loss is made infinite on purpose (its grads are no one's to compare); a
        partial overflow at ``k`` (``partial``) takes its place."""
        return bool(self.scaler) and k in self.case.scaler.overflow and not self.partial(k)

    def partial(self, k: int):
        """Step ``k``'s overflow in some grads only (case.Overflow), or None."""
        at = self.case.scaler.overflow_at if self.scaler else None
        return at if at is not None and at.step == k else None

    def inject(self, k: int, model) -> None:
        """The sharded run, after backward and before ``unscale_``: step ``k``'s
        partial overflow set in this rank's local grad, where it holds the
        element (a collective over the job where the param is a DTensor)."""
        at = self.partial(k)
        if at is not None:
            inject_local(model, at)

    def inject_full(self, k: int, grads: dict) -> dict:
        """The reference: step ``k``'s partial overflow set in the full grad
        (``grads``: {fqn: plain grad or None}), in place; ``grads`` back."""
        at = self.partial(k)
        g = grads.get(at.param) if at is not None else None
        if g is not None:
            with torch.no_grad():
                _set(g, at, overflow_value(at))
        return grads

    def scale_loss(self, k: int):
        """What a target applies to its loss before backward (None: nothing)."""
        if not self.scaler:
            return None
        inf = self.overflows(k)
        return lambda loss: self.scaler.scale(loss) * (math.inf if inf else 1.0)

    def scale_kwargs(self) -> dict:
        """What a target's reference_loss_grads takes of the scaler: its scale
        now (``scale``), for a reference whose low-precision grads depend on it
        (fsdp2's mixed precision); nothing without a scaler."""
        return {"scale": float(self.scaler.get_scale())} if self.scaler else {}

    def unscale(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.opt)

    def clip(self, params: list):
        """The total norm (a full tensor; None for clip_grad_value_), or no clip: None."""
        if not self.case.clip:
            return None
        return clip_grads(params, self.case.clip, self.full, self.own)

    def step(self, loss) -> None:
        """The optimizer's step (through the scaler), the scaler's update, the scheduler's step."""
        if self.scaler:
            self.scaler.step(self.opt)
            self.found_inf = found_inf(self.scaler, self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.step_lr(loss)

    def step_lr(self, loss) -> None:
        if self.lr is None:
            return
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        if isinstance(self.lr, ReduceLROnPlateau):
            self.lr.step(float(loss))  # the step's global loss: the same number on every rank and in the reference
        else:
            self.lr.step()

    def observe(self) -> dict:
        """What the loop holds after a step, as comparable tensors: the scale and
        whether the step found an inf (the scaler), the scheduler's last lrs."""
        out = {}
        if self.scaler:
            out["scale"] = torch.tensor(float(self.scaler.get_scale()), dtype=torch.float64)
            if self.found_inf is not None:  # whether the step was skipped: the scaler's decision, on every rank
                out["found_inf"] = torch.tensor(self._every(self.found_inf), dtype=torch.float64)
        if self.lr is not None and hasattr(self.lr, "get_last_lr"):
            out["last_lr"] = torch.tensor([float(v) for v in self.lr.get_last_lr()], dtype=torch.float64)
        return out

    # -- checkpoint: the scheduler's and the scaler's state, saved beside the model and optimizer ------------
    def state_dict(self) -> dict:
        out = {}
        if self.lr is not None:
            out["lr_scheduler"] = self.lr.state_dict()
        if self.scaler:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, sd: dict) -> None:
        if self.lr is not None:
            self.lr.load_state_dict(sd["lr_scheduler"])
        if self.scaler:
            self.scaler.load_state_dict(sd["scaler"])

    def save(self, path: str, kind: str, group) -> dict | None:
        """Collective over the saving job: the loop's state through DCP (a
        ``dcp`` checkpoint: torchtitan saves its schedulers as a Stateful in the
        same way) or torch.save on rank 0. Rank 0 returns what it saved."""
        if not (self.lr is not None or self.scaler):
            return None
        import torch.distributed as dist

        sd = self.state_dict()
        if kind == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save({"loop": sd}, storage_writer=dcp.FileSystemWriter(os.path.join(path, "loop")),
                     process_group=group)
        elif dist.get_rank() == 0:
            torch.save(sd, os.path.join(path, "loop.pt"))
        return comparable(sd)

    def load(self, path: str, kind: str, group) -> dict | None:
        """Collective over the loading job: the saved state into this loop; what it then holds."""
        if not (self.lr is not None or self.scaler):
            return None
        if kind == "dcp":
            import torch.distributed.checkpoint as dcp

            sd = {"loop": self.state_dict()}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "loop")), process_group=group)
            self.load_state_dict(sd["loop"])
        else:
            self.load_state_dict(torch.load(os.path.join(path, "loop.pt"), weights_only=False))
        return comparable(self.state_dict())


def found_inf(scaler, opt) -> float:
    """Whether ``scaler`` found an inf or a NaN in ``opt``'s grads this step
    (1.0: the step is skipped), as ``GradScaler.step`` reads it: any device's
    found_inf non-zero (ShardedGradScaler's all-reduce sums them: a count of
    the ranks that saw one, so only whether it is non-zero is compared)."""
    per_device = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    return float(any(float(v.sum()) != 0.0 for v in per_device.values()))


def overflow_value(at) -> float:
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[at.value]


def inject_local(model, at) -> None:
    """Set ``at``'s element (case.Overflow) in this rank's local grad of param
    ``at.param``, wherever the target keeps it: an FSDP1 FlatParameter's
    sharded grad (the original param's span of it on this rank), a DTensor's
    local grad (the elements of its shard, found by distributing the flat
    indices as the grad is placed: one scatter over its mesh, every rank
    calls it), a ShardedTensor's local shards, else a plain whole grad (a
    replica: every rank's copy). A rank that does not hold the element sets
    nothing; every copy of a replicated element is set."""
    from .model import named_params, plain_fqn

    value = overflow_value(at)
    with torch.no_grad():
        if _inject_fsdp1(model, at, value, plain_fqn):
            return
        p = named_params(model).get(at.param)
        if p is None:
            return
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor) or isinstance(p.grad, DTensor):
            g = p.grad
            if g is None:
                return
            from torch.distributed.tensor import Replicate, distribute_tensor
            from torch.distributed.tensor.placement_types import Partial

            # every rank must join the scatter, whether it holds the element or not
            ids = torch.arange(g.numel(), dtype=torch.int64, device=g.to_local().device).reshape(g.shape)
            placements = [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements]
            ids = distribute_tensor(ids, g.device_mesh, placements).to_local()
            local = g.to_local()
            mask = torch.ones_like(ids, dtype=torch.bool) if at.layer else ids == at.index
            if mask.any():
                local.masked_fill_(mask.to(local.device), value)
            return
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if isinstance(p, ShardedTensor):
            full = tuple(p.size())
            for shard in p.local_shards():
                t = shard.tensor
                if t.grad is None:
                    continue
                if at.layer:
                    t.grad.fill_(value)
                    continue
                at_full = [int(i) for i in torch.unravel_index(torch.tensor(at.index), full)] if full else []
                md = shard.metadata
                if all(o <= c < o + n for c, o, n in zip(at_full, md.shard_offsets, md.shard_sizes)):
                    t.grad[tuple(c - o for c, o in zip(at_full, md.shard_offsets))] = value
            return
        if p.grad is not None:
            _set(p.grad, at, value)


def _set(g: torch.Tensor, at, value: float) -> None:
    if at.layer:
        g.fill_(value)
    elif at.index < g.numel():
        g[tuple(int(i) for i in torch.unravel_index(torch.tensor(at.index), g.shape))] = value


def _inject_fsdp1(model, at, value: float, plain_fqn) -> bool:
    """FSDP1: the param's span of its FlatParameter's sharded grad on this
    rank (the original params' grads are views of it with use_orig_params);
    True where an FSDP1 handle holds the param (set or not on this rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not any(isinstance(m, FSDP) for m in model.modules()):
        return False
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    prefix = {id(m._handle): plain_fqn(n) for n, m in model.named_modules()
              if isinstance(m, FSDP) and m._handle is not None}
    for handle in _get_fsdp_handles(model):
        fp = handle.flat_param
        pre = prefix.get(id(handle), "")
        for fqn, info in zip(fp._fqns, fp._shard_param_infos):
            if (f"{pre}.{fqn}" if pre else fqn) != at.param:
                continue
            grad = handle.sharded_grad
            if grad is None or not info.in_shard:
                return True
            start, end = info.intra_param_start_idx, info.intra_param_end_idx
            if at.layer:
                grad[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard] = value
            elif start <= at.index <= end:
                grad[info.offset_in_shard + at.index - start] = value
            return True
    return False


def comparable(value):
    """A state dict as plain, comparable values (tensors as lists, callables by type)."""
    if isinstance(value, dict):
        return {str(k): comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__


# ---- fuzzshard.kernel.optim ------------------------------------------------
"""Build the optimizer of a Case, and move its state in and out by param FQN."""

import torch


# optimizers a plugin brings (fuzzshard.plugin.optimizer): name -> class, beside torch.optim's
USER_OPTIMIZERS: dict = {}


def optimizer_class(name: str):
    """The optimizer class a Case names: a plugin's, else torch.optim's."""
    return USER_OPTIMIZERS.get(name) or getattr(torch.optim, name)


# the loading side of a checkpoint builds its optimizer with every lr scaled by
# this, so a load that leaves a hyperparameter alone shows
RESUME_LR_SCALE = 0.5

# kwargs torch documents as tuples; a Case stores them as JSON lists
_TUPLE_KWARGS = ("betas", "etas", "step_sizes", "eps", "ns_coefficients")


def optimizer_kwargs(kwargs: dict, tensor_lr: str, device, lr_scale: float = 1.0) -> dict:
    out = {}
    for k, v in kwargs.items():
        if k in _TUPLE_KWARGS and isinstance(v, list):
            v = tuple(v)
        if k == "lr":
            v = v * lr_scale
        if k == "lr" and tensor_lr:
            # a tensor lr on the CPU, as users make it (torch.optim takes one on any device)
            v = torch.tensor(v) if tensor_lr == "0d" else torch.tensor([v])
        out[k] = v
    return out


def build_optimizer(model: torch.nn.Module, case: Case, lr_scale: float = 1.0, construct=None,
                    params: dict | None = None) -> torch.optim.Optimizer:
    """The optimizer over the Case's param groups, in the Case's order; frozen
    params stay in their groups (torch.optim skips params without a grad).
    ``lr_scale``: the loading side of a checkpoint starts from other lrs.
    ``construct(groups, **defaults)``: another constructor (a wrapper such as
    ZeroRedundancyOptimizer) in place of the torch.optim class. ``params``:
    {fqn: param} where the model's own names are not the plain FQNs (FSDP1).
    Groups a case adds mid-run are left out (``add_late_groups``)."""
    cls = construct or optimizer_class(case.optim.name)
    groups = _groups(model, case, lr_scale, params)
    n = len(groups) - case.optim.added_groups  # the rest go in through add_param_group
    opt = cls(groups[:n], **optimizer_kwargs(case.optim.kwargs, case.optim.tensor_lr, case.device, lr_scale))
    if not case.optim.added_at:
        for g in groups[n:]:
            opt.add_param_group(g)
    return opt


def resume_defaults(opt, case: Case) -> None:
    """Make a reference optimizer's defaults the loading side's: the
    constructor's with every lr scaled, plus what ``load_state_dict`` adds to
    them (``differentiable``); the load restores the groups, not the defaults,
    and a group added after it inherits them."""
    opt.load_state_dict(opt.state_dict())
    if "lr" in case.optim.kwargs:
        opt.defaults.update(optimizer_kwargs({"lr": case.optim.kwargs["lr"]}, case.optim.tensor_lr, case.device,
                                             RESUME_LR_SCALE))


def adds_groups_before(case: Case, k: int) -> bool:
    """Whether the case adds its late groups right before schedule step ``k``."""
    return 0 < case.optim.added_at == k


def add_late_groups(opt, model: torch.nn.Module, case: Case, params: dict | None = None) -> None:
    """The groups a case adds mid-run (before step ``case.optim.added_at``),
    at the case's lrs: nothing loaded them, so nothing scales them."""
    for g in _groups(model, case, 1.0, params)[len(case.groups) - case.optim.added_groups:]:
        opt.add_param_group(g)


def _groups(model: torch.nn.Module, case: Case, lr_scale: float, params: dict | None) -> list[dict]:
    params = params if params is not None else named_params(model)
    return [{"params": [(n, params[n]) if case.optim.named else params[n] for n in g.params],
             **optimizer_kwargs(g.overrides, case.optim.tensor_lr, case.device, lr_scale)} for g in case.groups]


def param_order(case: Case) -> list[str]:
    """FQNs in the index order torch.optim uses in ``state_dict()``."""
    return [n for g in case.groups for n in g.params]


def state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, full) -> dict[str, dict[str, torch.Tensor]]:
    """{fqn: {state name: full plain tensor}} for every param that has state.
    ``full`` turns a sharded tensor into a full local copy (a collective)."""
    names = {id(p): n for n, p in named_params(model).items()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out[names[id(p)]] = {k: _full_value(v, full) for k, v in sorted(st.items())}
    return out


def _full_value(v, full):
    if isinstance(v, torch.Tensor):
        return owned_copy(full(v))
    return torch.tensor(v)  # python scalars some optimizers keep


def group_hparams(opt: torch.optim.Optimizer) -> list[dict]:
    """Every group's hyperparameters (params excluded), as comparable values."""
    return [group_values(group) for group in opt.param_groups]


def group_values(group: dict, skip=("params", "param_names")) -> dict:
    """One param group (a live one or a state dict's) as comparable values: tensors as lists."""
    return {k: v.detach().cpu().tolist() if isinstance(v, torch.Tensor) else v
            for k, v in sorted(group.items()) if k not in skip}


def load_state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace ``opt``'s per-param state with copies of ``state`` (plain full
    tensors), dtypes kept: ``load_state_dict`` would cast float state such as
    NAdam's float32 ``mu_product`` to the param dtype and change the numerics."""
    params = named_params(model)
    on_device = {id(p): bool(g.get("fused") or g.get("capturable")) for g in opt.param_groups for p in g["params"]}
    opt.state.clear()
    for n, st in state.items():
        p = params[n]
        # torch.optim keeps ``step`` on the CPU unless the group is fused or capturable (load_state_dict too)
        opt.state[p] = {k: v.to("cpu" if k == "step" and not on_device.get(id(p)) else p.device).clone()
                        for k, v in st.items()}


# ---- fuzzshard.kernel.targets.base -----------------------------------------
"""The target interface, with the defaults most targets keep.

A target turns a plain model into its sharded form, builds the optimizer
under test, runs a forward/backward, and turns whatever it shards back into
full plain tensors for the oracles. Everything a target does not override
falls back to the plain torch.optim optimizer over ``model.named_parameters()``
and the state-dict round trip of ``torch.distributed.checkpoint``.
Every method that gathers is a collective: all ranks of the job call it in
the same order.
"""

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn



@dataclass(frozen=True)
class Spec:
    """What a target can do, said once, in its own module: the strategies draw
    from it, the Case checks, ``show`` and the findings read it; nothing else
    names a target. The callables run in the driver only (``options`` imports
    Hypothesis when it is called; a repro script never calls it)."""
    # the body of a Hypothesis composite: options(draw, shapes, mesh_shape, tied, **context) -> target_options
    # (context: model, n_groups, flat where may_flatten; loading=True and kind on a checkpoint's loading side)
    options: Callable | None = None
    checkpoint_kinds: dict = field(default_factory=dict)  # kind -> how it saves and loads (in draw order)
    data_parallel: bool = False  # each rank trains on its slice of the global batch
    named_params: bool = False  # the optimizer may take (name, param) pairs
    single_group: bool = False  # one flat set of params: no param groups
    elementwise_only: bool = False  # each shard steps on its own: only elementwise optimizers keep the math
    flat_mesh: bool = False  # one flat process group: 1-D meshes only
    may_flatten: bool = False  # may flatten params: a drawn "flat" case keeps one group and nothing frozen
    add_param_group: bool = False  # draws groups added through add_param_group (after the constructor or mid-run)
    # requires_grad recorded when it wraps (options -> bool): no freeze or unfreeze mid-run then
    flags_fixed: Callable | None = None
    # the body of a Hypothesis composite too: late_options(draw, case) -> target_options, the case's plus what
    # depends on the whole drawn case; drawn last of all, so the draws before stay as they were
    late_options: Callable | None = None
    # (case) -> {title: cells}: what a case covered of the target's own options, counted over a session's
    # passing cases and printed as "passing TITLE: cell N, ..." (fsdp2: decoder cases by TP plan element)
    coverage: Callable | None = None
    check: Callable | None = None  # (case) -> what makes the case impossible for this target, or None
    # (options, mesh_shape, n_steps) -> the options fitted to another mesh (the reducer's world and mesh edits):
    # what names mesh dims or ranks; given a copy, it may change it
    fit_options: Callable | None = None
    seq_multiple: Callable | None = None  # (options, mesh_shape) -> the sequence length is a multiple of this
    compiled: Callable | None = None  # (case) -> "" or a tag for what runs under torch.compile (in signatures)
    facts: Callable | None = None  # (case) -> {name: value}: derived facts a known finding's trigger can name
    models: tuple = ()  # a plugin's models this target takes, and only those (a parallelism written for them)
    component: str = ""  # the system under test as PyTorch's issue titles name it ("[FSDP2] ..."; upstream.py)
    # the training loop around the step it takes (kernel/loop.py; strategies/loop.py draws only these): the
    # clip forms ("norm", "two_part", "value", "own": its own clip_grad_norm_), an LR scheduler, a grad scaler
    clips: tuple = ()
    lr_scheduler: bool = False
    lr_scheduler_checkpoint: bool = True  # an LR scheduler beside a checkpoint (pp: no, per-rank states do not reshard)
    scaler: bool = False
    amp_scaler: bool = False  # its grad scaler is its own (ShardedGradScaler), and amp's is drawn too
    # the deepest built-in topology it draws (top-level layers), where more than the session's default: pp's
    # multi-stage schedules put 2 or 3 stages of one layer or more on each of up to 4 ranks
    max_depth: int = 0
    # how it places each param, as the dtensor target's placements say it: (mesh_shape, options, names) ->
    # {fqn: ["R" | "S<d>"] per mesh dim}, or None where it is no plain layout (a TP plan); and, for a target that
    # takes a layout as its options (dtensor), layout -> those options. findings/generalize.py carries a finding
    # to its kin targets through them: a case that places every param the same way there
    layout: Callable | None = None
    place_as: Callable | None = None


class Target:
    name = ""
    spec = Spec()  # what it can do (a target that says nothing runs plain cases: no options, no checkpoint)
    localizable = True  # per-module traces line up with the reference's (kernel/localize.py)
    freeze_before_shard = False  # set requires_grad before shard(), for wrappers that register trainable params

    @classmethod
    def step_device(cls, options: dict, device: str) -> str:
        """Where the optimizer steps the params under these target options
        (the reference steps there too: a CPU kernel rounds otherwise than a
        GPU one, and refuses other configs, capturable among them)."""
        return device

    @classmethod
    def step_devices(cls, case: Case, device: str) -> list[str]:
        """``step_device`` on either side of a checkpoint."""
        sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
        return sorted({cls.step_device(o, device) for o in sides})

    @classmethod
    def objective(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
        """The training loss under these target options, the reference's too: the
        plain loss, unless the target's options add to it (fsdp2's nonroot)."""
        return loss_fn(model(x), y)

    @classmethod
    def microbatches(cls, options: dict) -> int:
        """How many equal microbatches each data-parallel rank's slice is split
        into under these target options (a drawn batch is a multiple of it): 1,
        unless the target accumulates grads (fsdp2's microbatches)."""
        return 1

    @classmethod
    def step_tolerance(cls, case: Case, tol: dict) -> dict:
        """The optimizer step's tolerance: ``tol``, the eager step's, unless the
        target runs the step otherwise (fsdp2's compiled step)."""
        return tol

    def build_dtype(self) -> str:
        """The dtype the model is built in, before ``shard``: the case's, unless
        the target moves it there after sharding (fsdp2's built_as)."""
        return self.case.dtype

    @classmethod
    def reference_batch(cls, case: Case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """(inputs, targets, loss scale) the reference trains step k on: the
        whole global batch, unless the target trains on less (zero's uneven inputs)."""
        return x, y, 1.0

    @classmethod
    def documented_refusal(cls, case: Case, error: dict) -> bool:
        """Whether the sharded run's error (an error record: type, message) is
        a config the system under test refuses by design, as its docs say (pp's
        schedules: fewer microbatches than stages): the case is invalid, not a
        finding. False: the reference decides (an error only the sharded side
        raises is a finding)."""
        return False

    @classmethod
    def reference_loss_grads(cls, case: Case, model: nn.Module, options: dict, world: int, x, y,
                             scale: float = 1.0) -> tuple | None:
        """The reference's loss and grads for a step run with these target
        options, where the target's math is not the plain model's (fsdp2's
        mixed precision): (loss, {fqn: grad}, tolerance, sensitivity,
        {fqn: elementwise allowance}); None: the plain forward/backward.
        ``scale``: the grad scaler's scale this step (passed only where the
        case has a scaler): the grads computed from the loss times it, as
        the sharded run's are, and returned unscaled, as ``unscale_`` leaves them."""
        return None

    def __init__(self, case: Case, mesh):
        self.case = case
        self.mesh = mesh

    @property
    def dp_dims(self) -> list[int]:
        """The mesh dims the batch is split over (all of them unless a target
        uses one for something else, as fsdp2's TP does)."""
        return list(range(self.mesh.ndim))

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (row-major over ``dp_dims``)."""
        rank = 0
        for dim in self.dp_dims:
            rank = rank * self.mesh.size(dim) + self.mesh.get_local_rank(dim)
        return rank

    def dp_size(self) -> int:
        return math.prod(self.mesh.size(dim) for dim in self.dp_dims)

    def replica_quantities(self, device: str) -> tuple[str, ...]:
        """What the replica oracle compares across the ranks after each step
        (kernel/gather.py): every rank's full copy of the grads, params,
        optimizer state and hyperparameters must be bit for bit the same, as
        each rank's replicas are made by collectives or by the same
        deterministic op on the same inputs. A target whose ranks compute a
        replicated grad each on their own (``local_replicas``) keeps only the
        hyperparameters on a device whose kernels may sum in another order on
        each run (CUDA's atomics): there the first grad that differs by
        rounding makes every step after it differ too."""
        if self.local_replicas and device != "cpu":
            return ("groups",)
        return ("grads", "params", "state", "groups")

    # each rank computes the grads of replicated params itself, from replicated activations (DTensor's
    # Replicate placements), not through a collective
    local_replicas = False

    def shard(self, model: nn.Module) -> nn.Module:
        """The model to train; its params keep their plain FQNs (``named_params``
        leaves wrappers out)."""
        return model

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        return build_optimizer(model, self.case, lr_scale)

    def add_groups(self, opt, model: nn.Module) -> None:
        """The case's mid-run ``add_param_group`` calls."""
        add_late_groups(opt, model, self.case)

    @contextlib.contextmanager
    def uneven(self, model: nn.Module, opt, observe_grads, observe_step, record):
        """Around the training loop: yields ``runs(k)``, whether this rank runs
        step k itself. A target that trains on uneven inputs (zero under Join)
        yields fewer steps and shadows the rest: ``observe_grads`` and
        ``observe_step`` are the loop's collectives, ``record`` takes each
        shadowed step's record."""
        yield lambda k: True

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        """(this rank's loss to backward, the global mean loss as a plain tensor)."""
        loss = loss_fn(model(x), y)
        return loss, loss

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Fill the grads for the global batch ``x``; return the global mean loss."""
        loss, full_loss = self.loss(model, x, y)
        self.backward(loss)
        return full_loss

    # the training loop's loss scaling for the step running (kernel/loop.py: GradScaler.scale), or None
    scale_loss = None

    # whether the optimizer this target's grad scaler steps takes the scaler's found_inf itself where its class
    # does (torch.optim's fused ones: _step_supports_amp_scaling, the kernel skips the update and may still
    # make state): False for a wrapper that does not pass it on (ZeroRedundancyOptimizer, ShardedOptimizer),
    # whose whole step GradScaler skips instead; the reference's optimizer then goes the same way (reference.py)
    amp_scaling_step = True

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the loss as the loop scales it (every target's backward goes through here)."""
        (self.scale_loss(loss) if self.scale_loss else loss).backward()

    def grad_scaler(self, **kwargs):
        """The grad scaler a user pairs with this target (torch.amp.GradScaler;
        FSDP's ShardedGradScaler where the target shards grads)."""
        return torch.amp.GradScaler(self.mesh.device_type, **kwargs)

    def clip_own(self, model: nn.Module):
        """The target's own clip_grad_norm_(max_norm, norm_type) (FSDP1's), for a Clip of how "own"."""
        raise NotImplementedError(f"{self.name} has no clip_grad_norm_ of its own")

    def full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """A total grad norm as a user reads it: a DTensor's ``full_tensor()`` (torchtitan's), else itself."""
        from torch.distributed.tensor import DTensor

        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def loop(self, opt, model: nn.Module):
        """The training loop around this target's step (kernel/loop.py)."""
        amp = self.case.scaler and self.case.scaler.amp  # amp's GradScaler in place of the target's own
        return Loop(self.case, opt, scaler=None if amp else self.grad_scaler, full=self.full_norm,
                    own=self.clip_own(model) if (self.case.clip and self.case.clip.how == "own") else None)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """A full plain copy of a param, grad or state tensor."""
        return t

    @classmethod
    def trace_points(cls, case: Case):
        """The modules localizing traces, as a predicate on plain FQNs; None:
        every leaf module. The sharded run and the reference trace the same ones."""
        return None

    def full_activation(self, t: torch.Tensor, fqn: str = "") -> torch.Tensor:
        """Module ``fqn``'s output as the reference sees it (the whole batch), for localizing."""
        return self.full(t)

    def full_activation_grad(self, g: torch.Tensor, fqn: str = "") -> torch.Tensor:
        return self.full(g)

    def full_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return None if p.grad is None else self.full(p.grad)

    def params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{fqn: full copy} of every param."""
        return {n: owned_copy(self.full(p)) for n, p in named_params(model).items()}

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """{fqn: full copy of the grad, or None} of every param."""
        out = {}
        for n, p in named_params(model).items():
            g = self.full_grad(p)
            out[n] = None if g is None else owned_copy(g)
        return out

    def noncontiguous_grads(self, model: nn.Module) -> list[str]:
        """The params whose grad, as some rank's step kernel reads it, is not
        contiguous: what a fused kernel that assumes contiguity misreads. A
        DTensor grad placed otherwise than its param is read as the step's
        sharding strategy redistributes it (to the param's placements), so it is
        redistributed here the same way to look. Collectives over the case's
        mesh (every rank calls them, in the same order)."""
        from torch.distributed.tensor import DTensor, Partial

        params = named_params(model)

        def as_read(p):
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                with torch.no_grad():
                    g = g.redistribute(p.device_mesh, p.placements)
            return g.to_local() if isinstance(g, DTensor) else g

        local = [as_read(p) for p in params.values()]
        flags = torch.tensor([float(g is not None and not g.is_contiguous()) for g in local] or [0.0],
                             device=self.mesh.device_type)
        total = DTensor.from_local(flags, self.mesh, [Partial()] * self.mesh.ndim, run_check=False).full_tensor()
        return [n for n, f in zip(params, total.tolist()) if f > 0]

    def grad_spreads(self, model: nn.Module) -> dict:
        """{fqn: (sum of |partial grads|, number of partials)} for grads the
        optimizer may reduce in another order than the gather did (dtensor)."""
        return {}

    def set_requires_grad(self, model: nn.Module, fqns, flag: bool) -> None:
        params = named_params(model)
        for n in fqns:
            params[n].requires_grad_(flag)

    def apply_flags(self, model: nn.Module, step) -> None:
        """A schedule step's freezes and unfreezes."""
        self.set_requires_grad(model, step.freeze, False)
        self.set_requires_grad(model, step.unfreeze, True)

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        """{fqn: {state name: full tensor}} for every param that has state."""
        return state_by_fqn(opt, model, self.full)

    def group_hparams(self, opt) -> list[dict]:
        return group_hparams(opt)

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        """Collective over the saving job; the reporting rank returns the full
        state dict it saved, keyed by FQN (None for a sharded save)."""
        return save(self.case, model, opt, path, group)

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        load(self.case, model, opt, path, group)


# ---- fuzzshard.kernel.plain ------------------------------------------------
"""The unsharded model and optimizer of a case, as the oracles use them: built
the same way the sharded run builds its own, stepped through the case's
schedule (freezes, late param groups, the target options each step ran with),
anchored on a sharded run's recorded state, and probed for how far one ulp of
rounding moves a result. The reference replay (reference.py), the checkpoint
oracles (checkpoint.py) and a target's own reference hooks (base.Target) all
start from here.
"""

import torch



def torch_dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)


def setup(case: Case, device: str):
    """(model, optimizer), unsharded, with the case's initially frozen params."""
    model = build_model(case.model, case.seed, device, torch_dtype(case))
    for n in case.frozen:
        model.get_parameter(n).requires_grad_(False)
    return model, build_optimizer(model, case)


def before_step(model, opt, case: Case, k: int) -> None:
    """A step's freezes and unfreezes, and the groups the case adds before it."""
    apply_flags(model, case.schedule[k])
    if adds_groups_before(case, k):
        add_late_groups(opt, model, case)


def apply_flags(model, step) -> None:
    for n in step.freeze:
        model.get_parameter(n).requires_grad_(False)
    for n in step.unfreeze:
        model.get_parameter(n).requires_grad_(True)


def options_at(case: Case, k: int) -> tuple[dict, int]:
    """The target options and world size step k ran with (the loading side's after a checkpoint)."""
    ck = case.checkpoint
    return (ck.target_options, ck.world_size) if ck and k > ck.after else (case.target_options, case.world_size)


def anchor(model, opt, case: Case, rec: dict) -> None:
    """Make the reference exactly the sharded run's state after the previous
    step. The grads too: zero_grad clears only the optimizer's params, so the
    grad of a param in no group yet (added mid-run) accumulates over steps."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec["params"][n])
            g = rec["grads"][n]
            p.grad = None if g is None else g.to(p.device).clone()
    load_state_by_fqn(opt, model, rec["state"])


SENSITIVITY_DRAWS = 4


def sensitivity(model, params: dict, x, y, objective, scale: float = 1.0) -> dict[str, float]:
    """How far one ulp moves each result: rerun forward/backward with every
    param and float input nudged by one ulp (random direction, fixed seed),
    and take the largest change per tensor. Rounding anywhere in a legitimate
    run acts like such nudges, so k times this bounds it even where a result
    cancels to ~0 (e.g. through a LayerNorm over a near-constant row).
    ``objective(model, x, y)``: the loss (the target's, under the step's options)."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(1234)  # fixed: a replay measures the same bound

    def nudge(t):
        up = torch.rand(t.shape, generator=g) < 0.5
        return torch.nextafter(t, torch.where(up.to(t.device), torch.tensor(float("inf"), dtype=t.dtype, device=t.device),
                                              torch.tensor(float("-inf"), dtype=t.dtype, device=t.device)))

    def run(perturb: bool):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(nudge(saved[n]) if perturb else saved[n])
                p.grad = None
        xin = nudge(x) if perturb and x.is_floating_point() else x
        loss = objective(model, xin, y) * scale
        loss.backward()
        return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}

    la, ga = run(False)
    out = {"loss": 0.0}
    for _ in range(SENSITIVITY_DRAWS):  # one draw can read 0 by chance (a flat rounding step)
        lb, gb = run(True)
        out["loss"] = max(out["loss"], float((la - lb).abs().max()))
        for n in params:
            if ga[n] is not None and gb[n] is not None and ga[n].numel():
                out[n] = max(out.get(n, 0.0), float((ga[n] - gb[n]).abs().max()))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
            p.grad = grads_before[n]
    return out


# ---- fuzzshard.kernel.localize ---------------------------------------------
"""Name the module behind a loss or grad divergence.

Each traced output (and its grad) is compared with the reference's and, in
the sharded run, across the ranks: every rank's full copy is the whole
tensor as the reference has it (``Target.full_activation``: a ``Replicate``
DTensor's local tensor, TP's whole plain activation, a gathered batch), so
they must agree. A copy that one rank holds otherwise was made wrong by the
op that wrote it, though the reporting rank's copy may be right and the
divergence reach the reference only through a later module that reads the
bad copy (a Conv1d that labels an unreduced output ``Replicate``, read by a
head sharded on its input dim)."""

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves


PHASES = ("fwd", "bwd")


class Trace:
    """Records each traced module's output (forward order) and the grad of
    that output (backward order), as full tensors. Used only to name the first
    diverging module once a loss or grad divergence is known: it decides no
    verdict, so its tolerance cannot cause a false positive.

    ``points``: which modules, by plain FQN (Target.trace_points); None: every
    leaf. ``full(t, fqn)`` / ``full_grad(g, fqn)``: the whole-batch plain
    tensor of a module's output or its grad, as the reference has it.
    ``replicas``: the sharded run's trace, on every rank of the job: ``take``
    then also gathers every rank's copy of each entry that differs between
    ranks (a collective over the job's default group)."""

    def __init__(self, model, full, full_grad, points=None, replicas: bool = False):
        self.full, self.full_grad, self.replicas, self.handles = full, full_grad, replicas, []
        self._clear()
        seen = set()
        for name, mod in model.named_modules():
            fqn = plain_fqn(name)
            if not name or fqn in seen or not (points(fqn) if points else not list(mod.children())):
                continue
            seen.add(fqn)  # a wrapper and the module it wraps share a plain FQN: the outer one is traced
            kind = type(mod).__name__
            kind = kind[4:] if kind.startswith("FSDP") else kind  # fully_shard renames the class
            kind = type(getattr(mod, "_checkpoint_wrapped_module", mod)).__name__ if kind == "CheckpointWrapper" else kind
            self.handles.append(mod.register_forward_hook(self._hook(fqn, kind)))

    def _clear(self):
        # fwd: (name, kind, copy); bwd: (name, kind, copy, index of its output in fwd);
        # outs: the traced output objects (kept alive, so an id() names one); readers: fwd index -> its readers
        self.fwd, self.bwd, self.outs, self.readers = [], [], [], {}

    def _hook(self, name, kind):
        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                return
            at = len(self.fwd)
            made = {id(t): i for i, t in enumerate(self.outs)}
            for i in sorted({made[id(a)] for a in tree_leaves(args) if id(a) in made}):
                self.readers.setdefault(i, []).append(at)
            self.fwd.append((name, kind, self.full(out, name).detach().clone()))
            self.outs.append(out)
            if out.requires_grad:
                out.register_hook(lambda g: self.bwd.append((name, kind, self.full_grad(g, name).detach().clone(), at)))

        return hook

    def take(self):
        out = {"fwd": self.fwd, "bwd": self.bwd, "readers": self.readers}
        if self.replicas:
            out["replicas"] = differing_copies(out)
        self._clear()
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def differing_copies(traced: dict, group=None) -> dict:
    """{phase: {index: {rank: copy}}} of every traced tensor whose copies
    differ between the ranks of ``group`` (the job's default group): a
    collective, the lowest rank's answer filled, {} elsewhere. A digest per
    copy first (gather.py's), whole copies only where digests differ; ranks
    whose traces differ in length cannot be lined up and compare nothing."""
    entries = [(phase, i, e[2]) for phase in PHASES for i, e in enumerate(traced[phase])]
    simulated = _simulated_copies(entries)
    if simulated is not None:
        return simulated
    n = dist.get_world_size(group)
    if n == 1:
        return {}
    device = _comm_device(group)
    head = torch.tensor([len(traced[p]) for p in PHASES], dtype=torch.int64)
    heads = torch.empty(n * len(PHASES), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(heads, head.to(device), group=group)
    heads = heads.view(n, len(PHASES)).cpu()
    if not bool((heads == heads[0]).all()) or not entries:
        return {}
    mine = _digests([t for _, _, t in entries])
    table = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, mine.reshape(-1).to(device), group=group)
    table = table.view(n, *mine.shape).cpu()
    differ = [j for j in range(len(entries)) if not bool((table[:, j] == table[0, j]).all())]
    if not differ:
        return {}
    every = [None] * n
    dist.all_gather_object(every, [_portable(entries[j][2]) for j in differ], group=group)
    if dist.get_rank(group) != 0:
        return {}
    out: dict = {}
    for k, j in enumerate(differ):
        phase, i, _ = entries[j]
        out.setdefault(phase, {})[i] = {r: copies[k] for r, copies in enumerate(every)}
    return out


def _simulated_copies(entries: list) -> dict | None:
    """Under torch's LocalTensorMode (a simulated run, one process for every
    rank) each copy is one LocalTensor holding every rank's: all of them, as
    {phase: {index: {rank: copy}}}, with no collective (the fake group's
    refuse plain tensors); None outside that mode."""
    try:
        from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
    except ImportError:  # torch < 2.10: no simulation
        return None
    if enabled_local_tensor_mode() is None:
        return None
    out: dict = {}
    for phase, i, t in entries:
        if isinstance(t, LocalTensor):
            out.setdefault(phase, {})[i] = {r: t._local_tensors[r] for r in sorted(t._local_tensors)}
    return out


def localize_divergence(got: dict, want: dict, tol: dict) -> dict | None:
    """The first module whose output diverges (forward order), else the first
    whose output grad diverges (backward order): the module that consumed
    that output computed a wrong input grad, and is named. Diverges: the
    reporting rank's copy differs from the reference's, or the ranks' copies
    differ from each other (``got["replicas"]``, the same tolerance)."""
    replicas = got.get("replicas") or {}
    for phase in PHASES:
        for i, (mine, theirs) in enumerate(zip(got[phase], want[phase])):
            name, kind, g = mine[:3]
            if name != theirs[0]:
                break  # the call orders differ: cannot localise further
            quantity = "forward" if phase == "fwd" else "backward"
            m = compare(quantity, -1, name, g, theirs[2], tol)
            if m is None and i in replicas.get(phase, {}):
                m = compare_replicas(quantity, -1, name, replicas[phase][i], tol)
            if m:
                what = "output" if phase == "fwd" else "output grad"
                m["detail"] = f"{what} of {name} ({kind}): {m['detail']}"
                if phase == "bwd":
                    name, kind = _reader(got, i)
                    m["fqn"], m["detail"] = name, f"{m['detail']}, from the backward of {name} ({kind})"
                m["module"] = kind
                return m
    return None


def _reader(got: dict, i: int) -> tuple[str, str]:
    """(name, kind) of the module whose backward made bwd entry ``i``, the grad
    of some module's output: the one traced module that read that output in
    forward; else (an untraced op between them, several readers) the module
    whose output grad came just before in backward order; else (the loss read
    it) the module itself."""
    name, kind, _, at = got["bwd"][i]
    readers = got.get("readers", {}).get(at, [])
    if len(readers) == 1:
        return got["fwd"][readers[0]][:2]
    if i > 0:
        return got["bwd"][i - 1][:2]
    return name, kind


# ---- fuzzshard.kernel.reference --------------------------------------------
"""The anchored reference: replay the plain model step by step from the
sharded run's own state and compare (see run.py for the whole picture).

Before step k the reference loads the sharded params and optimizer state
after step k-1, so float noise never compounds; loss and grads are compared
with the reduction tolerance (plus measured sensitivity), and the optimizer
step, taken from the sharded grads, with the step tolerance.
"""

import contextlib
import functools
import math

import torch



def step_tolerance_for(case: Case, numel: int, target_cls) -> dict:
    """Adafactor reduces over a param (row/column means); Muon's Newton-Schulz
    runs in bfloat16 whatever the param dtype, one reduction per iteration."""
    if case.optim.name == "Adafactor":
        return step_tolerance(case.dtype, 4 * numel)
    if case.optim.name == "Muon":
        return step_tolerance("bfloat16", case.optim.kwargs.get("ns_steps", 5))
    return target_cls.step_tolerance(case, step_tolerance(case.dtype))  # fsdp2's compiled step widens it


def scalar_dtype(case: Case) -> str:
    """The dtype torch.optim keeps ``step`` in (``optimizer._get_scalar_dtype``:
    float32 for a fused step, else float64 only under a float64 default dtype),
    which a compiled step computes its scalar factors in."""
    from torch.optim.optimizer import _get_scalar_dtype

    return str(_get_scalar_dtype(is_fused=bool(case.optim.kwargs.get("fused")))).removeprefix("torch.")


def reference_error(case: Case, device: str, target_cls) -> dict | None:
    """Run the plain reference schedule un-anchored; its exception's record, if any."""
    try:
        model, opt = setup(case, device)
        loop = Loop(case, _scaler_path(target_cls, opt))
        for k, step in enumerate(case.schedule):
            before_step(model, opt, case, k)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, torch_dtype(case))
            options, world = options_at(case, k)
            scaled = loop.scale_loss(k) or (lambda t: t)
            # the same casts, or errors; with the loss scaled as the grad scaler scales it (not its drawn overflow)
            own = target_cls.reference_loss_grads(case, model, options, world, x, y, **loop.scale_kwargs())
            if own is not None:
                loss = own[0]
                for n, p in model.named_parameters():
                    p.grad = None if own[1][n] is None else scaled(own[1][n])
            else:
                x, y, scale = target_cls.reference_batch(case, k, x, y)
                loss = target_cls.objective(model, x, y, options) * scale
                scaled(loss).backward()
            loop.inject_full(k, {n: p.grad for n, p in model.named_parameters()})  # a partial overflow
            loop.unscale()
            loop.clip(list(model.parameters()))
            loop.step(loss.detach())
    except Exception as e:
        return error_record(e)
    return None


def _scaler_path(target_cls, opt):
    """``opt``, stepped by a grad scaler as the target's optimizer is: where that
    is a wrapper that does not take the scaler's found_inf (``amp_scaling_step``
    False: ZeRO, ShardedOptimizer), GradScaler skips its whole step on an inf,
    so a fused reference optimizer is not handed found_inf either (its kernel
    would skip the update but still make state)."""
    if not target_cls.amp_scaling_step:
        opt._step_supports_amp_scaling = False
    return opt


def reduction_length(case: Case) -> int:
    """Longest chain of summed terms behind a loss or grad element (see oracles)."""
    if case.model.factory:
        return _user_reduction_length(case)
    return math.prod(reduction_parts(case))


def reduction_parts(case: Case) -> tuple[int, int, int, int, int]:
    """reduction_length of a built-in topology as its factors (a standalone
    script shows them): batch, seq, widest dim, conv kernel, depth + 1."""
    dims, kernel, depth = [case.model.d_in], 1, 1

    def walk(layers, mult):
        nonlocal kernel, depth
        for layer in layers:
            dims.extend([layer.d_in, layer.d_out])
            kernel = max(kernel, layer.kernel)
            if layer.kind in ("linear", "embedding", "conv1d", "layernorm"):
                depth += mult
            walk(layer.children, mult * (2 if layer.kind == "twice" else 1))

    walk(case.model.layers, 1)
    return case.batch, case.seq, max(dims), kernel, depth + 1


def _user_reduction_length(case: Case) -> int:
    """A plugin's model, read from its params: the widest dim of any param
    (a matmul's contraction), the kernel of any conv-like param (dims past
    the second), and as depth the modules holding params. Counting every
    param module as one more link in the chain over-counts the parallel ones
    (q, k, v), which covers the parameter-free reductions between them
    (attention's two matmuls, a norm's mean)."""
    shapes = param_shapes(case.model)
    dims = [case.model.d_in, out_dim(case.model)] + [d for s in shapes.values() for d in s]
    kernel = max([math.prod(s[2:]) for s in shapes.values() if len(s) > 2] or [1])
    depth = len({n.rsplit(".", 1)[0] for n in shapes}) + 1
    return case.batch * case.seq * max(dims) * kernel * (depth + 1)


def check_parity(case: Case, obs: dict, device: str, target_cls, localize: bool = False, clock=None) -> dict:
    """``target_cls``: the target the sharded run ran, for its reference hooks
    (base.Target): where its optimizer steps under a step's target options
    (where that is not ``device``, CPU offload, the reference steps a twin of
    its model and optimizer there), the batch and the loss and grads it
    computes where they are not the plain model's. ``clock``: run.Clock,
    to time the comparisons apart from the replay."""
    part = clock or (lambda name: contextlib.nullcontext())
    dtype = torch_dtype(case)
    step_device = target_cls.step_device
    try:
        model, opt = setup(case, device)
        twins = {device: (model, opt)}
        for d in {step_device(options_at(case, k)[0], device) for k in range(len(case.schedule))}:
            if d not in twins:
                twins[d] = setup(case, d)
    except Exception as e:
        return invalid(f"reference rejects the config: {error_record(e)['text']}")
    # the loop around each twin's step (loop.py)
    loops = {d: Loop(case, _scaler_path(target_cls, o)) for d, (_, o) in twins.items()}
    red_tol = reduction_tolerance(case.dtype, reduction_length(case))
    numel = max([p.numel() for p in model.parameters()] or [1])
    step_tol = step_tolerance_for(case, numel, target_cls)
    params = dict(model.named_parameters())
    mismatches = _compare_state(-1, obs["init_state"], state_by_fqn(opt, model, lambda t: t), step_tol)
    prev = {"params": obs["init"], "state": obs["init_state"], "grads": {n: None for n in params}}
    for k, step in enumerate(case.schedule):
        rec = obs["steps"][k]
        if case.checkpoint and k == case.checkpoint.after + 1:
            # a resumed run starts without grads (they are not checkpointed) and from the
            # state as loaded: the values were checked equal to the saved ones, and the
            # dtype is what optimizer.load_state_dict gives (it casts float32 NAdam
            # mu_product to a float64 param's dtype)
            loaded = obs.get("loaded") or {}
            for _, o in twins.values():
                resume_defaults(o, case)
            prev = {**prev, "grads": {n: None for n in params}, "state": loaded.get("state", prev["state"]),
                    "params": loaded.get("params", prev["params"])}  # a non-strict load may miss a param
        stepper = twins[step_device(options_at(case, k)[0], device)]
        try:
            for m, o in twins.values():
                before_step(m, o, case, k)
            anchor(model, opt, case, prev)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            options, world = options_at(case, k)
            trace, extra = None, {}
            own = target_cls.reference_loss_grads(case, model, options, world, x, y,
                                                  **loops[step_device(options, device)].scale_kwargs())
            if own is not None:
                loss, grads, tol, sens, extra = own
            else:
                x, y, scale = target_cls.reference_batch(case, k, x, y)
                sens = None  # measured below, only if a comparison fails without it
                trace = Trace(model, lambda t, fqn: t, lambda t, fqn: t, target_cls.trace_points(case)) if localize and rec["trace"] else None
                loss = target_cls.objective(model, x, y, options) * scale
                loss.backward()
                grads, tol = {n: p.grad for n, p in params.items()}, red_tol
            # an overflow in some grads only: the same non-finite value in the same element of the full grad
            loops[device].inject_full(k, grads)
            traced = None
            if trace:  # its hooks are done with this step: off before any nudged pass below could add to it
                traced = trace.take()
                trace.remove()

            overflow = loops[device].overflows(k)  # the loss made infinite on purpose: no grads to compare

            def loss_and_grads(sens: dict) -> list:
                out = [compare("loss", k, "", rec["loss"], loss.detach(), tol, sens=sens.get("loss", 0.0))]
                out += [compare("grad", k, n, rec["grads"][n], grads[n], tol, sens=sens.get(n, 0.0),
                                extra=extra.get(n)) for n in params if not overflow]
                return [m for m in out if m]

            with part("compare"):
                here = loss_and_grads(sens or {})
            if here and sens is None:
                # a sensitivity only widens a bound: what matches without it matches with it, so the
                # five forward/backward passes that measure it run only where something does not
                sens = sensitivity(model, params, x, y, functools.partial(target_cls.objective, options=options), scale)
                with part("compare"):
                    here = loss_and_grads(sens)
            if traced is not None:  # name the module behind this step's divergence, if it has one
                culprit = localize_divergence(rec["trace"], traced, red_tol) if here else None
                if culprit:
                    culprit["step"] = k
                    return finding("parity", [m for m in mismatches if m] + [culprit] + here)
            mismatches += here
            if stepper[0] is not model:
                anchor(*stepper, case, prev)
            with torch.no_grad():  # step from the sharded grads: isolates the optimizer
                for n, p in stepper[0].named_parameters():
                    g = rec["grads"][n]
                    p.grad = None if g is None else g.to(p.device).clone()
            with part("compare"):
                mismatches += _loop_step(case, k, loops, step_device(options_at(case, k)[0], device), stepper, rec,
                                         red_tol)
        except Exception as e:
            ref_error = reference_error(case, device, target_cls)
            if ref_error is not None:
                return invalid(f"reference raises: {ref_error['text']}")
            why = f"the reference could not replay the sharded state: {error_record(e)['text']}"
            return finding("parity", [m for m in mismatches if m] + [Mismatch("reference replay", "", k, why).to_dict()])
        with part("compare"):
            rel = _grad_uncertainty(case, rec)
            model_s, opt_s = stepper
            stepped = []
            groups = {id(q): g for g in opt_s.param_groups for q in g["params"]}
            state_extra = {}  # a compiled step's allowance for state derived from the new param
            for n, p in model_s.named_parameters():
                before = prev["params"][n].to(p.device)
                update = (p.detach() - before).abs()
                extra = None if n not in rel else PARTIAL_GRAD_READS * rel[n] * update
                if "update_rel" in step_tol:  # a compiled step (oracles.compiled_step_tolerance)
                    group = groups.get(id(p))
                    allow = compiled_step_allowance(step_tol, case.optim.name, group, update, before, p.grad,
                                                    opt_s.state.get(p))
                    state_extra[n] = lambda key, group=group, allow=allow: compiled_state_allowance(
                        case.optim.name, group, key, allow)
                    extra = allow + (0 if extra is None else extra)
                stepped.append(compare("param", k, n, rec["params"][n], p.detach(), step_tol, extra=extra))
            stepped += _compare_state(k, rec["state"], state_by_fqn(opt_s, model_s, lambda t: t), step_tol, rel,
                                      state_extra)
            stepped.append(compare_hparams(k, rec["groups"], group_hparams(opt_s)))
            loop_checks = _compare_loop(k, rec.get("loop") or {}, loops[step_device(options_at(case, k)[0], device)])
            # whether the scaler skipped the step comes first: a wrong decision is what the params then show
            skipped = [m for m in loop_checks if m and m["quantity"] == "loop.found_inf"]
            stepped = skipped + stepped + [m for m in loop_checks if m not in skipped]
            for m in stepped:  # a fused step that read a non-contiguous grad: part of what names the bug
                if m and m["fqn"] in rec.get("noncontig", ()):
                    m["grad"] = "non-contiguous"
            mismatches += stepped
        # the grads the next step starts from are the clipped ones (a clip works in place): a param in no group
        # yet (added mid-run) keeps its clipped grad past zero_grad and accumulates the next backward onto it
        prev = {**rec, "grads": rec["clipped"]} if case.clip and "clipped" in rec else rec
    mismatches = [m for m in mismatches if m]
    return finding("parity", mismatches) if mismatches else passing()


def _compare_state(k: int, got_state: dict, want_state: dict, tol: dict, rel: dict | None = None,
                   compiled: dict | None = None) -> list:
    """Step -1 is the state right after the optimizer constructor. ``compiled``:
    {fqn: key -> a compiled step's allowance for that state, or None}."""
    out = []
    for n in sorted(set(want_state) | set(got_state)):
        got, want = got_state.get(n, {}), want_state.get(n, {})
        for key in sorted(set(got) | set(want)):
            w = want.get(key)
            extra = None
            if rel and n in rel and w is not None and w.shape == rel[n].shape:
                extra = PARTIAL_GRAD_READS * rel[n] * w.abs()
            more = compiled[n](key) if compiled and n in compiled else None
            if more is not None and w is not None and w.shape == more.shape:
                extra = more if extra is None else extra + more
            key_tol = compiled_scalar_state_tolerance(tol) if "update_rel" in tol and key in SCALAR_STATE else tol
            out.append(compare(f"state.{key}", k, n, got.get(key), w, key_tol, extra=extra))
    return out


# An elementwise optimizer reads the grad at most twice in one formula (g / |g|
# in Adagrad's first step); each read may carry its own reduction error.
PARTIAL_GRAD_READS = 4


def _grad_uncertainty(case: Case, rec: dict) -> dict:
    """Per param whose grad was Partial: the relative error, per element, of any
    one reduction of it. Summing n partials in two orders differs by at most
    2(n-1) u sum|partials|, plus u|g| for the final rounding; where the partials
    cancel (|g| << sum|partials|) the step is legitimately undetermined."""
    u = UNIT_ROUNDOFF[case.dtype]
    out = {}
    for n, (abs_sum, parts) in rec.get("grad_spread", {}).items():
        g = rec["grads"][n]
        delta = (2 * (parts - 1) + 1) * u * abs_sum.to(g.device)
        out[n] = delta / g.abs().clamp_min(torch.finfo(g.dtype).tiny)
    return out


# ---- the training loop around the step (loop.py): scaler, clipping, scheduler ----

LOOP_EXACT = {"k_ulps": 0, "u": 0.0, "why": "the same numbers on both sides: exact"}


def clip_tolerance(case: Case, tol: dict, numel: int) -> dict:
    """A total grad norm, and grads scaled by max_norm / norm, from the sharded
    grads: the norm is a reduction over every grad element (in per-shard
    partial norms, then across ranks, in another order than the plain one), so
    ``reduction_tolerance`` of that length on top of the grads' own; the
    infinity norm is a max: exact, but for the grads it was read from."""
    if case.clip.norm_type == "inf":
        return tol
    n = numel + 2 * len(case.groups) + 2  # the elements, a norm per tensor and the stacked norm's terms
    red = reduction_tolerance(case.dtype, n)
    return {**red, "k_ulps": red["k_ulps"] + tol["k_ulps"] + 4,
            "why": f"a norm over {numel} grad elements reduced in another order: {red['why']}"}


def _loop_step(case: Case, k: int, loops: dict, at: str, stepper: tuple, rec: dict, tol: dict) -> list:
    """Step the reference from the sharded grads (set on ``stepper``'s params)
    through the loop around it, as the sharded run did: the scaler's unscale
    (of the grads scaled by its current scale: the same powers of two, exact),
    the clip (its norm and clipped grads compared with the sharded run's, and
    then the sharded clipped grads stepped), the step (skipped on a non-finite
    grad), the scaler's update and the scheduler's step (fed the sharded loss)."""
    loop, (model_s, opt_s) = loops[at], stepper
    out = []
    if loop.scaler:
        # a partial overflow set in the sharded grads too (the gathered copy holds it already where the run
        # kept it): the reference's skip is decided by its own grads, the truth every rank must agree on
        loop.inject_full(k, {n: p.grad for n, p in model_s.named_parameters()})
        scale = loop.scaler.scale(torch.ones((), device=next(model_s.parameters(), torch.zeros(())).device))
        with torch.no_grad():
            for p in model_s.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        loop.unscale()
    if case.clip:
        params = dict(model_s.named_parameters())
        numel = sum(p.numel() for p in params.values() if p.grad is not None)
        clip_tol = clip_tolerance(case, tol, numel)
        norm = loop.clip(list(params.values()))
        if norm is not None:
            out.append(compare("clip_norm", k, "", rec.get("clip_norm"), norm, clip_tol))
        for n, p in params.items():
            out.append(compare("clipped_grad", k, n, rec["clipped"][n], p.grad, clip_tol))
        with torch.no_grad():  # the step from the sharded clipped grads: isolates the optimizer again
            for n, p in params.items():
                g = rec["clipped"][n]
                p.grad = None if g is None else g.to(p.device).clone()
    loop.step(rec["loss"])
    for d, other in loops.items():  # a twin that did not step keeps the same lrs
        if d != at:
            other.step_lr(rec["loss"])
    return out


def _compare_loop(k: int, got: dict, loop) -> list:
    """The scale and the scheduler's last lrs after step k: exact (they are not computed from the data)."""
    want = loop.observe()
    if got.get("found_inf") is not None and want.get("found_inf") is not None:  # every rank's vs the reference's
        want["found_inf"] = want["found_inf"].expand_as(got["found_inf"])
    return [compare(f"loop.{key}", k, "", got.get(key), want.get(key), LOOP_EXACT) for key in sorted(set(got) | set(want))]


# ---- fuzzshard.kernel.targets.ddp ------------------------------------------
"""Target ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (or the
composable ``torch.distributed._composable.replicate``) around the whole model.

Every rank holds the whole model and trains on its slice of the global batch;
DDP averages the grads in buckets during the backward. The optimizer is the
plain torch.optim one on every rank. ``target_options``:
  - ``ddp``: DDP's kwargs where they differ from its defaults: static_graph,
    find_unused_parameters, gradient_as_bucket_view, bucket_cap_mb (tiny: each
    param, or a few, a bucket of its own after the first iteration's rebuild),
    broadcast_buffers, init_sync;
  - ``microbatches``: gradient accumulation, the first m-1 forward/backwards of
    every step (the first step's included) under ``no_sync()``;
  - ``synced_first``: the wrapper's first this many steps sync every
    microbatch (no no_sync): accumulation starts once DDP has seen a step;
  - ``gate``: the FQN of a top-level residual layer whose inner part a rank
    skips on a microbatch whose input sums above 0 (float inputs; tokens: an odd
    sum): the graph changes between steps and between ranks, and the skipped
    params go unused on some ranks only (find_unused_parameters, no static_graph);
  - ``ignore``: params DDP ignores (``_set_params_and_buffers_to_ignore_for_model``),
    whose grads the loop averages by hand, as a user who ignores them must;
  - ``hook``: a comm hook: {"name": allreduce | fp16 | bf16 | fp16_wrapper |
    powersgd, and PowerSGD's "rank", "start", "feedback", "warm", "min_rate"};
  - ``uneven``: per rank, how many schedule steps it runs, under ``Join``;
  - ``replicate``: ``_composable.replicate(model, **ddp)`` in place of the wrapper
    (``set_requires_gradient_sync`` for no_sync);
  - ``plain`` (a loading side): the checkpoint loaded into the plain model
    (DSD's ``set_state_dict`` on it; the ``module`` kind: the wrapper's state
    dict with its ``module.`` prefix consumed), not into the wrapper.
What must hold beyond parity: every rank's grads and params are bit for bit the
same (the replica oracle). Lossy comm hooks are compared within their rounding
(``reference_loss_grads``); PowerSGD's grads (a low-rank approximation by
design) only by the replica oracle, and the steps from them by parity.
"""

import contextlib
import dataclasses
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

HOOKS = ("allreduce", "fp16", "bf16", "fp16_wrapper", "powersgd")
LOSSY = {"fp16": "float16", "bf16": "bfloat16", "fp16_wrapper": "float16"}
BUCKET_CAPS = (1e-6, 4e-5, 1e-3)  # MiB: 1 byte (a bucket per param), a few params, ~1000 floats
MODULE_FILE = "ddp_module.pt"
CHECKPOINT_KINDS = {**STATE_DICT_KINDS,
                    "module": "the wrapper's state_dict() (module. prefix) and optimizer.state_dict(), torch.save on "
                              "rank 0; load_state_dict into the wrapper, or into the plain model (plain)"}


def _residuals(model) -> list[str]:
    """Top-level residual layers with params: what ``gate`` may skip."""
    if model is None or getattr(model, "factory", None):
        return []
    return [f"layers.{i}" for i, layer in enumerate(model.layers)
            if layer.kind == "residual" and _has_params(layer)]


def _has_params(layer) -> bool:
    return layer.kind in ("linear", "embedding", "layernorm", "conv1d") or any(_has_params(c) for c in layer.children)


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), model=None, loading: bool = False,
                 kind: str = "", **_) -> dict:
    """DDP's flags (each its default first), then now and then grad
    accumulation, a gated residual, ignored params, a comm hook, replicate()."""
    import hypothesis.strategies as st

    out, ddp = {}, {}
    if loading and draw(st.booleans()):  # the checkpoint loaded into the plain model, not the wrapper
        out["plain"] = True
    static = draw(st.booleans())
    unused = bool(model is not None and model.unused)
    gates = _residuals(model)
    gate = gates and not static and draw(st.integers(0, 3)) == 3
    if static:
        ddp["static_graph"] = True
    # an unused submodule or a gated layer needs find_unused_parameters (or static_graph) : DDP's documented error
    if gate or (unused and not static) or draw(st.booleans()):
        ddp["find_unused_parameters"] = True
    if draw(st.booleans()):
        ddp["gradient_as_bucket_view"] = True
    cap = draw(st.sampled_from((None,) + BUCKET_CAPS))
    if cap is not None:
        ddp["bucket_cap_mb"] = cap
    if draw(st.booleans()):
        ddp["broadcast_buffers"] = False
    if draw(st.booleans()):
        ddp["init_sync"] = False
    if ddp:
        out["ddp"] = ddp
    m = draw(st.sampled_from([1, 1, 2, 3]))
    if m > 1:
        out["microbatches"] = m
        if draw(st.booleans()):  # the wrapper's first step syncs every microbatch: no_sync from its second on
            out["synced_first"] = 1
    if gate:
        out["gate"] = draw(st.sampled_from(gates))
    trainable = sorted(n for n in shapes if not n.startswith("unused."))
    if len(trainable) > 1 and draw(st.integers(0, 5)) == 5:
        tied_names = {n for n in shapes if n.rsplit(".", 1)[0] in tied}
        pick = [n for n in trainable if n not in tied_names]
        if pick:
            out["ignore"] = [draw(st.sampled_from(pick))]
    if "ignore" not in out and draw(st.integers(0, 5)) == 5:
        out["replicate"] = True
    return out


def joinable(case) -> bool:
    """Join applies to DDP (it is Joinable; replicate() is not) with every
    trainable param used (a joined rank cannot tell an unused param's zero grad
    from a real one), no comm hook of the case's own (Join's DDP hook shadows
    the default all-reduce; the kernel registers its own averaging), one
    forward/backward a step, no checkpoint and no loop around the step."""
    o = case.target_options
    return (case.world_size > 1 and len(case.schedule) > 1 and case.checkpoint is None and not case.model.unused
            and not any(k in o for k in ("replicate", "hook", "gate", "microbatches", "ignore")))


def draw_late_options(draw, case) -> dict:
    """Now and then a comm hook (the saving side's); then, where ``joinable``,
    now and then uneven inputs under Join: rank r runs the first counts[r]
    steps, one rank all of them."""
    import hypothesis.strategies as st

    out = dict(case.target_options)
    # a comm hook, now and then: drawn once the device and dtype are known (bf16_compress_hook raises on CPU; the
    # compressing hooks are not drawn for a low-precision model)
    hooks = [h for h in HOOKS if not (h == "bf16" and case.device == "cpu")
             and not (h in LOSSY and case.dtype not in ("float32", "float64"))]
    if draw(st.integers(0, 3)) == 3:
        hook = {"name": draw(st.sampled_from(hooks))}
        if hook["name"] == "powersgd":
            hook["rank"] = draw(st.integers(1, 2))
            hook["feedback"] = draw(st.booleans())
            hook["warm"] = draw(st.booleans())
            # PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start (documented)
            hook["start"] = draw(st.integers(2 if hook["feedback"] or hook["warm"] else 1, 3))
            hook["min_rate"] = draw(st.sampled_from([0.0, 2.0]))  # 0: every matrix compressed, however small
        out["hook"] = hook
        case = dataclasses.replace(case, target_options=out)
    if joinable(case) and draw(st.integers(0, 3)) == 3:
        n_steps, world = len(case.schedule), case.world_size
        counts = [draw(st.integers(1, n_steps)) for _ in range(world)]
        counts[draw(st.integers(0, world - 1))] = n_steps
        out["uneven"] = counts
    return out


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """uneven holds a step count per rank, one of them every step."""
    world = math.prod(mesh_shape)
    if "uneven" in options:
        counts = (options["uneven"] + [n_steps] * world)[:world]
        if max(counts) != n_steps:
            counts[-1] = n_steps
        options["uneven"] = counts
    return options


def check(case) -> str | None:
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    for o in sides:
        ddp, hook = o.get("ddp", {}), o.get("hook") or {}
        if ddp.get("static_graph") and o.get("gate"):
            return "static_graph with a graph that changes between steps (DDP's docs: the used params never change)"
        if o.get("gate") and not ddp.get("find_unused_parameters"):
            return "a gated layer without find_unused_parameters (DDP's documented error)"
        if case.model.unused and not (ddp.get("find_unused_parameters") or ddp.get("static_graph")):
            return "an unused submodule without find_unused_parameters or static_graph (DDP's documented error)"
        if o.get("gate") and o["gate"] not in _residuals(case.model):
            return f"gate {o['gate']}: no top-level residual layer with params"
        if o.get("replicate") and o.get("ignore"):
            return "replicate() ignores modules, not params"
        if hook.get("name") == "powersgd" and (hook.get("feedback") or hook.get("warm")) and hook.get("start", 1) <= 1:
            return "PowerSGD with error feedback or warm start from iteration 1 (PowerSGDState refuses it)"
        if hook.get("name") == "bf16" and case.device == "cpu":
            return "bf16_compress_hook on CPU (it raises: it requires CUDA 11+ and NCCL 2.10+, as documented)"
        if hook.get("name") in LOSSY and (case.dtype not in ("float32", "float64") or case.scaler):
            return "a compressing comm hook on a low-precision model or under a grad scaler (its grads overflow float16)"
    for world, o in [(case.world_size, case.target_options)] + \
            ([(case.checkpoint.world_size, case.checkpoint.target_options)] if case.checkpoint else []):
        if case.batch % (world * o.get("microbatches", 1)):
            return f"batch {case.batch}: not {world} ranks' equal slices in {o.get('microbatches', 1)} equal microbatches"
    uneven = case.target_options.get("uneven")
    if uneven and (case.clip or case.lr_scheduler or case.scaler):
        return "uneven inputs under Join: a joined rank's step is shadowed without the loop (clip, scaler, lr)"
    if uneven is not None and (len(uneven) != case.world_size or max(uneven) != len(case.schedule) or min(uneven) < 1):
        return (f"uneven inputs {uneven}: want one step count in 1..{len(case.schedule)} per rank of "
                f"{case.world_size}, one of them {len(case.schedule)}")
    if uneven and not joinable(case):
        return "uneven inputs where Join does not apply (see kernel/targets/ddp.py joinable)"
    return None


def coverage(case) -> dict:
    """DDP's features a case used: its flags, the comm hook, accumulation, gate, Join, replicate."""
    from .fsdp1 import loop_coverage

    o = case.target_options
    used = sorted(o.get("ddp", {})) + [k for k in ("microbatches", "gate", "ignore", "uneven", "replicate") if o.get(k)]
    if o.get("hook"):
        used.append(f"hook {o['hook']['name']}")
    out = loop_coverage(case, "replicate()" if o.get("replicate") else "DDP")
    out["DDP features"] = used or ["defaults"]
    return out


def facts(case) -> dict:
    o = case.target_options
    return {"hook": (o.get("hook") or {}).get("name", ""), "static_graph": bool(o.get("ddp", {}).get("static_graph")),
            "no_sync": o.get("microbatches", 1) > 1, "gate": bool(o.get("gate"))}


class _JoinShadow(Joinable):
    """A Joinable whose join hook runs ``fn``: a joined rank's part in the
    collectives (and the step) the training loop runs after DDP's."""

    def __init__(self, fn, group, model: nn.Module):
        super().__init__()
        self.fn, self.group, self.device = fn, group, next(model.parameters()).device

    def join_hook(self, **kwargs) -> JoinHook:
        hook = JoinHook()
        hook.main_hook = self.fn
        return hook

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.group


def _gated_forward(layer):
    """A Residual whose inner part is skipped while ``layer._fuzz_skip`` is set."""
    def forward(x):
        return x if layer._fuzz_skip else x + layer.inner(x)
    return forward


def skips(x: torch.Tensor) -> bool:
    """Whether a gated layer is skipped on this microbatch: a function of the input alone."""
    return bool(x.sum() % 2 == 1) if not x.is_floating_point() else bool(x.double().sum() > 0)


@contextlib.contextmanager
def gated(model: nn.Module, fqn: str | None):
    """The model with ``fqn`` gated (``layer._fuzz_skip``), back to itself on leaving."""
    if not fqn:
        yield None
        return
    layer = model.get_submodule(fqn)
    layer._fuzz_skip = False
    layer.forward = _gated_forward(layer)
    try:
        yield layer
    finally:
        del layer.forward
        del layer._fuzz_skip


class DDPTarget(Target):
    name = "ddp"
    spec = Spec(options=draw_options, data_parallel=True, flat_mesh=True, named_params=True,
                late_options=draw_late_options, checkpoint_kinds=CHECKPOINT_KINDS,
                flags_fixed=lambda options: True, check=check, fit_options=fit_options, facts=facts,
                component="DDP", coverage=coverage,
                # full grads on every rank before the step: torch.nn.utils' clips and a plain GradScaler see what
                # a local model's would
                clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True)
    freeze_before_shard = True  # DDP registers the params that require grad when it wraps

    @classmethod
    def documented_refusal(cls, case: Case, error: dict) -> bool:
        """DDP over a module with no param that requires grad (all frozen, or ignored): it raises, as documented."""
        return "doesn't have any parameter that requires a gradient" in error.get("message", "")

    @classmethod
    def microbatches(cls, options: dict) -> int:
        return options.get("microbatches", 1)

    @classmethod
    def reference_batch(cls, case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """With uneven inputs only the ranks that still run step k contribute
        their slices, and DDP averages over the whole world (by its initial
        size): the grad of the sum over active ranks of their mean loss / W."""
        counts = case.target_options.get("uneven")
        if not counts:
            return x, y, 1.0
        per = x.shape[0] // len(counts)
        active = [r for r, n in enumerate(counts) if n > k]
        pick = torch.cat([torch.arange(r * per, (r + 1) * per) for r in active]).to(x.device)
        return x[pick], y[pick], len(active) / len(counts)

    @classmethod
    def reference_loss_grads(cls, case: Case, model: nn.Module, options: dict, world: int, x, y,
                             scale: float = 1.0) -> tuple | None:
        """Where the math is not the plain model's on the whole batch: each
        rank's microbatches on its slice, the gated layer skipped where that
        microbatch's input says (the same function of the same data as the
        sharded run's), the grads averaged in float64. A lossy comm hook rounds
        each rank's grad to its dtype (float16, bfloat16), divides by W there
        and sums W of them there, then casts back: 2(W+1) ulps of that dtype of
        sum|rank grads|/W (oracles.mixed_precision_tolerance, plus half its
        subnormal spacing per rounding), beside the float64 sum's own
        reduction tolerance. PowerSGD's grads are a low-rank approximation by
        design: any finite value passes here (the replica oracle compares them)."""
        hook = (options.get("hook") or {}).get("name")
        if not options.get("gate") and hook not in (*LOSSY, "powersgd"):
            return None
        orig = torch_dtype(case)
        params = dict(model.named_parameters())
        per, m = x.shape[0] // world, options.get("microbatches", 1)
        loss, total, spread, sens = torch.zeros((), dtype=torch.float64), {}, {}, {}
        before = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        with gated(model, options.get("gate")) as layer:
            for r in range(world):
                acc = {}
                for xm, ym in zip(x[r * per:(r + 1) * per].chunk(m), y[r * per:(r + 1) * per].chunk(m)):
                    if layer is not None:
                        layer._fuzz_skip = skips(xm)
                    objective = functools.partial(cls.objective, options=options)
                    for key, v in sensitivity(model, params, xm, ym, objective, 1.0 / m).items():
                        sens[key] = sens.get(key, 0.0) + v / world
                    for p in params.values():
                        p.grad = None
                    local = objective(model, xm, ym) / m
                    # GradScaler.scale: times its float32 scale tensor, cast back to the loss's dtype; unscaled below
                    (local if scale == 1.0 else (local * torch.tensor(scale, dtype=torch.float32)).type(local.dtype)).backward()
                    loss = loss + local.detach().double() / world
                    for n, p in params.items():
                        if p.grad is not None:
                            acc[n] = acc[n] + p.grad if n in acc else p.grad.clone()
                for n, g in acc.items():
                    g = g.double() / scale
                    total[n] = total.get(n, 0) + g
                    spread[n] = spread.get(n, 0) + g.abs()
        red = reduction_tolerance(case.dtype, reduction_length(case))
        grads, extra = {}, {}
        for n, p in params.items():
            p.grad = before[n]
            new = None if n not in total else (total[n] / world).to(orig)
            grads[n] = before[n] if new is None else new if before[n] is None else before[n] + new
        if hook in LOSSY:
            low = mixed_precision_tolerance(case.dtype, LOSSY[hook], world)
            for n in spread:
                extra[n] = low["k_ulps"] * (low["u"] * spread[n] / world + low["eta"])
            red = {**red, "why": f"{red['why']}; plus {low['why']} (comm hook {hook})"}
            if LOSSY[hook] == "float16":  # past float16's range: inf, as the hook's sum gives
                for n, t in total.items():
                    compressed = [t / world]
                    over = compressed[0].to(torch.float16).isinf() & t.isfinite()
                    grads[n] = torch.where(over, t.sign() * torch.inf, grads[n].double()).to(orig)
        elif hook == "powersgd":
            for n in total:
                extra[n] = torch.full_like(total[n], torch.inf)
            red = {**red, "why": f"{red['why']}; PowerSGD's grads: any finite value (a low-rank approximation)"}
        return loss.to(orig), grads, red, sens, extra

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        self.group = mesh.get_group()
        self.wrapper = None
        self.joined = False
        self.layer = None
        self.steps_run = 0  # forward_backward calls so far (synced_first)

    @property
    def localizable(self) -> bool:
        """Per-module traces line up with the reference's with one forward per
        step on every rank (a joined rank has none; a gated layer's differ by rank)."""
        o = self.case.target_options
        return not self.counts and not o.get("gate") and self.microbatches(o) == 1

    def full_activation(self, t: torch.Tensor, fqn: str = "") -> torch.Tensor:
        """The global-batch activation from every rank's slice, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self._world())]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def full_activation_grad(self, g: torch.Tensor, fqn: str = "") -> torch.Tensor:
        # each rank's loss is a mean over its slice: its output grads are world x the global ones
        return self.full_activation(g, fqn) / self._world()

    @property
    def counts(self) -> list[int] | None:
        return self.case.target_options.get("uneven")

    def _world(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, model: nn.Module) -> nn.Module:
        o = self.case.target_options
        kwargs = dict(o.get("ddp", {}))
        device = next(model.parameters()).device
        if o.get("gate"):  # for the model's life (the reference gates its own model while it computes)
            self.layer = model.get_submodule(o["gate"])
            self.layer._fuzz_skip = False
            self.layer.forward = _gated_forward(self.layer)
        if o.get("replicate"):
            from torch.distributed._composable.replicate import replicate

            replicate(model, device_id=device, process_group=self.group, **kwargs)
            self.wrapper = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            if o.get("ignore"):
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(o["ignore"]))
            self.wrapper = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device],
                                                   process_group=self.group, **kwargs)
        self._register_hook()
        return model  # the plain module: its FQNs; the forward goes through the wrapper

    def _register_hook(self) -> None:
        hook = self.case.target_options.get("hook")
        if self.counts:
            self.wrapper.register_comm_hook(None, self._allreduce_setting_joined_grads)
            return
        if not hook:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

        name = hook["name"]
        if name == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            state = ps.PowerSGDState(process_group=self.group, matrix_approximation_rank=hook["rank"],
                                     start_powerSGD_iter=hook["start"], min_compression_rate=hook["min_rate"],
                                     use_error_feedback=hook["feedback"], warm_start=hook["warm"])
            self.wrapper.register_comm_hook(state, ps.powerSGD_hook)
            return
        fn = {"allreduce": dh.allreduce_hook, "fp16": dh.fp16_compress_hook, "bf16": dh.bf16_compress_hook,
              "fp16_wrapper": dh.fp16_compress_wrapper(dh.allreduce_hook)}[name]
        self.wrapper.register_comm_hook(self.group, fn)

    def _allreduce_setting_joined_grads(self, state, bucket):
        """DDP's averaging as a comm hook; on a joined rank its result (the active ranks' grads) is made this
        rank's grads, which its shadowed step then steps from (kernel/targets/zero.py's, the same)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        fut = allreduce_hook(self.group, bucket)
        if not self.joined:
            return fut

        def set_grads(done):
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                p.grad = g.detach().clone()
            return done.value()

        return fut.then(set_grads)

    @contextlib.contextmanager
    def uneven(self, model: nn.Module, opt, observe_grads, observe_step, record):
        """Uneven inputs under ``Join([ddp, ...])``: DDP's join hook shadows
        the all-reduce (the comm hook makes its result a joined rank's grads),
        and fuzzshard's own hooks shadow the loop's loss all-reduce, its
        observation gathers and the step (the local optimizer, from those
        grads: what keeps a joined rank's replica with the others')."""
        if not self.counts:
            yield lambda k: True
            return
        pending = {}
        device = next(model.parameters()).device

        def after_backward():
            loss = torch.zeros((), dtype=next(model.parameters()).dtype, device=device)
            dist.all_reduce(loss, group=self.group)
            pending.update({"loss": loss / self._world(), **observe_grads()})

        def after_step():
            record({**pending, **observe_step(), "trace": None})

        mine = self.counts[dist.get_rank(self.group)]
        with Join([self.wrapper, _JoinShadow(after_backward, self.group, model), _JoinShadow(opt.step, self.group, model),
                   _JoinShadow(after_step, self.group, model)]):
            yield lambda k: k < mine
            self.joined = True

    def _sync(self, on: bool):
        """no_sync() as the wrapper has it (replicate(): set_requires_gradient_sync)."""
        if self.case.target_options.get("replicate"):
            self.wrapper.set_requires_gradient_sync(on)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if on else self.wrapper.no_sync()

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice in ``microbatches`` parts, all but the last under
        no_sync (each loss / m); ignored params' grads averaged by hand."""
        world, rank = self._world(), dist.get_rank(self.group)
        m = self.microbatches(self.case.target_options)
        per = x.shape[0] // world
        xs, ys = x[rank * per:(rank + 1) * per].chunk(m), y[rank * per:(rank + 1) * per].chunk(m)
        total = None
        synced = self.steps_run < self.case.target_options.get("synced_first", 0)
        self.steps_run += 1
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if self.layer is not None:
                self.layer._fuzz_skip = skips(xm)
            with self._sync(synced or i == m - 1):
                loss = loss_fn(self.wrapper(xm), ym) / m
                self.backward(loss)
            total = loss.detach().clone() if total is None else total + loss.detach()
        if self.case.target_options.get("replicate"):
            self.wrapper.set_requires_gradient_sync(True)
        params = dict(model.named_parameters())
        for n in self.case.target_options.get("ignore", ()):
            g = params[n].grad
            if g is not None:
                dist.all_reduce(g, group=self.group)
                g.div_(world)
        dist.all_reduce(total, group=self.group)
        return total / world

    # ---- checkpoints: DSD on the wrapper, or the wrapper's own state_dict ----

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        if self.case.checkpoint.kind != "module":
            return save(self.case, self.wrapper, opt, path, group)  # DSD on the wrapper
        rank = dist.get_rank(self.group)
        file = os.path.join(path, MODULE_FILE)
        if rank == 0:
            torch.save({"model": self.wrapper.state_dict(), "optim": opt.state_dict()}, file)
        dist.barrier(group=self.group)
        if rank != 0:
            return None
        saved = torch.load(file, map_location="cpu")
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        msd = dict(saved["model"])
        consume_prefix_in_state_dict_if_present(msd, "module.")
        order = param_order(self.case)
        osd = saved["optim"]
        by_fqn = {"state": {order[i]: st for i, st in osd["state"].items()},
                  "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
        return {"model": msd, "optim": by_fqn}

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        if self.case.checkpoint.kind != "module":
            plain = self.case.target_options.get("plain")  # set_state_dict on the plain model, or the wrapper
            load(self.case, model if plain else self.wrapper, opt, path, group)
            return
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        saved = torch.load(os.path.join(path, MODULE_FILE), map_location="cpu")
        msd = saved["model"]
        into_wrapper = not self.case.target_options.get("plain") and not self.case.target_options.get("replicate")
        prefixed = all(k.startswith("module.") for k in msd)
        if into_wrapper and prefixed:
            self.wrapper.load_state_dict(msd)  # as saved: DDP's module. prefix on both sides
        else:
            msd = dict(msd)
            consume_prefix_in_state_dict_if_present(msd, "module.")
            (self.wrapper.module if into_wrapper else model).load_state_dict(msd)
        opt.load_state_dict(saved["optim"])


# ---- fuzzshard.kernel.checkpoint -------------------------------------------
"""The checkpoint oracles: what must survive a round trip (save mid-schedule,
load into a fresh model and optimizer, possibly on another world size, mesh
or wrapping; the saving and loading are state_io.py's and the targets').
The loading side starts from a different init and every lr halved, so a load
that silently does nothing, for a param, a state tensor or a hyperparameter,
shows. The oracles, in the order they run (training parity is run.py's):
  - *saved*: the full state dict saved on rank 0 equals what the plain model's
    ``state_dict()`` and the plain optimizer's ``state_dict()`` hold for the
    same state, keys by FQN: every tensor, ``step``, every group's params and
    hyperparameters, frozen and never-stepped params included;
  - *loaded*: right after the load the params, optimizer state and every
    group's hyperparameters equal the saved ones exactly (a copy, not math);
  - training then continues, and the anchored parity check of the continued
    steps against the reference is the usual one.
"""


EXACT = {"k_ulps": 0, "u": 0.0, "why": "a checkpoint copies values: exact"}


def check_saved(case: Case, saved: dict, rec: dict, device: str) -> list[dict]:
    """The full state dict on rank 0 vs the plain model's and optimizer's
    ``state_dict()`` holding the same params and state (``rec``: the sharded
    run's record of the step it saved after)."""
    step = case.checkpoint.after
    model, opt = setup(case, device)
    if 0 < case.optim.added_at <= step:
        add_late_groups(opt, model, case)
    anchor(model, opt, case, rec)
    if case.lr_scheduler:
        # the loop's scheduler moved the hyperparameters (and gave each group its initial_lr): they are the
        # sharded run's after this step, which the parity oracle holds to the reference loop's every step
        for group, values in zip(opt.param_groups, rec["groups"]):
            group.update(values)
    want_model, got_model = model.state_dict(), saved["model"]
    out = [compare("saved.model", step, key, got_model.get(key), want_model.get(key), EXACT)
           for key in sorted(set(want_model) | set(got_model))]
    want = opt.state_dict()
    index = {id(p): n for n, p in model.named_parameters()}
    by_index = [index[id(p)] for g in opt.param_groups for p in g["params"]]
    want_state = {by_index[i]: {k: as_tensor(v) for k, v in st.items()} for i, st in want["state"].items()}
    got_state = {n: {k: as_tensor(v) for k, v in st.items()} for n, st in saved["optim"].get("state", {}).items()}
    out += _compare_states("saved.optim.state", step, got_state, want_state)
    want_groups = [{**grp, "params": [by_index[i] for i in grp["params"]]} for grp in want["param_groups"]]
    got_groups = saved["optim"].get("param_groups", [])
    for i, (g, w) in enumerate(zip(got_groups, want_groups)):
        if sorted(g.get("params", [])) != sorted(w["params"]):
            out.append(Mismatch("saved.optim.param_groups.params", f"group {i}", step,
                                f"{g.get('params')} vs reference {w['params']}").to_dict())
    out.append(_prefixed("saved.optim.", compare_hparams(step, [group_values(g, skip=("params",)) for g in got_groups],
                                                         [group_values(w, skip=("params",)) for w in want_groups])))
    return [m for m in out if m]


def check_loaded(case: Case, loaded: dict, rec: dict) -> list[dict]:
    """Params, state and hyperparameters right after the load vs what was saved."""
    ck, step = case.checkpoint, case.checkpoint.after
    if ck.strict and (ck.missing or ck.unexpected):  # the load went through: it should not have
        keys = [f"missing {list(ck.missing)}"] * bool(ck.missing) + [f"unexpected {UNEXPECTED_KEY!r}"] * ck.unexpected
        return [Mismatch("loaded.strict", ", ".join(ck.missing + (UNEXPECTED_KEY,) * ck.unexpected), step,
                         f"a strict load accepted a model state dict with {' and '.join(keys)} keys; "
                         f"load_state_dict(strict=True) refuses it").to_dict()]
    # a non-strict load leaves a missing param as the fresh model had it
    want = {**rec["params"], **loaded.get("fresh", {})}
    out = [compare("loaded.param", step, n, loaded["params"][n], want[n], EXACT) for n in rec["params"]]
    out += _compare_states("loaded.state", step, loaded["state"], rec["state"])
    out.append(_prefixed("loaded.", compare_hparams(step, loaded["groups"], rec["groups"])))
    return [m for m in out if m]


def _compare_states(what: str, step: int, got: dict, want: dict) -> list[dict]:
    """{fqn: {name: tensor}} both sides, exactly; a param whose whole state
    appeared or vanished is one ``.extra`` / ``.missing`` mismatch."""
    out = []
    for n in sorted(set(got) | set(want)):
        g, w = got.get(n, {}), want.get(n, {})
        if not g or not w:
            out.append(Mismatch(f"{what}.{'missing' if w else 'extra'}", n, step,
                                f"expected state {sorted(w)}, got {sorted(g)}").to_dict())
            continue
        out += [compare(f"{what}.{key}", step, n, g.get(key), w.get(key), EXACT) for key in sorted(set(g) | set(w))]
    return out


def _prefixed(prefix: str, m: dict | None) -> dict | None:
    if m:
        m["quantity"] = prefix + m["quantity"]
    return m


def check_loaded_loop(case: Case, saved: dict | None, loaded: dict | None) -> list[dict]:
    """The LR scheduler's and grad scaler's state right after the load vs what
    was saved (kernel/loop.py: plain values), key by key: exact."""
    if not saved and not loaded:
        return []
    out = []

    def walk(path: str, got, want):
        if isinstance(got, dict) and isinstance(want, dict):
            for key in sorted(set(got) | set(want)):
                walk(f"{path}.{key}", got.get(key), want.get(key))
        elif isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
            for i, (g, w) in enumerate(zip(got, want)):
                # a dict's place names it (SequentialLR's _schedulers.1); a value's does not, a 1-d tensor's
                # (a list: a tensor lr's _last_lr[2][0]) no more than a float's: which param group shows first
                # is incidental, as the hyperparameter is for the optimizer's (oracle/checkpoint.py)
                walk(f"{path}.{i}" if isinstance(g, dict) else f"{path}[{i}]", g, w)
        elif got != want and not (got != got and want != want):  # NaN equals NaN
            at = f" at {path[path.index('['):]}" if "[" in path else ""  # the entry: [group] of a tensor lr's list
            out.append(Mismatch(f"loaded.{path.split('[')[0]}", "", case.checkpoint.after,
                                f"{got!r} loaded, {want!r} saved{at}").to_dict())

    walk("", loaded or {}, saved or {})
    for m in out:
        m["quantity"] = m["quantity"].replace("loaded..", "loaded.")
    return out[:1] + out[1:8]  # the first is what names the finding; a few more say how far it goes


# ---- fuzzshard.kernel.run --------------------------------------------------
"""Run one Case: the sharded training on every rank, then the reference check.

The sharded run records, after every step, the full (gathered) loss, grads,
params, optimizer state and param-group hyperparameters. The reporting rank
then replays the reference *anchored*: before step k it loads the sharded
run's params and state after step k-1, so float noise never compounds over
steps and every divergence is caught at the step that made it:
  - loss and grads of step k vs the reference forward/backward on the same
    params and data (reduction tolerance);
  - params, state and hyperparameters after step k vs the reference
    optimizer stepping from the same params, state *and grads* (step tolerance).
With a checkpoint in the case, the run stops after the save step, saves,
and a fresh model + optimizer on the loading world (another size, mesh or
wrapping) loads and runs the remaining steps; checkpoint.py says what the
round trip must preserve, and the continued steps get the same parity check.
A verdict is the dict verdict.py's builders make: status pass | invalid | finding.

Where the ranks run is the ``meshes`` a case is handed, a kernel/mesh.py
``World``: the seam. Besides its meshes, groups and jobs it says what every
rank makes alike (``made_alike``: the model before sharding, each step's
batch), what the reporting rank holds of the observations (``observed``) and
which full copies gather.py may batch (``batchable``). Real process groups
(mesh.Meshes) take the defaults; kernel/simulated.py's SimulatedWorld (every
rank in one process, under LocalTensorMode: ``fuzz --simulate``) gives its own,
and nothing here changes for it.
"""

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist



def run_case(case: Case, meshes, target_cls, device: str, reporter: bool, timings: dict | None = None,
             localize: bool = False, ckpt_dir: str | None = None) -> dict | None:
    """Ranks 0..case.ranks-1 call this (``meshes``: kernel/mesh.py); only the
    reporter returns a verdict unless the sharded run raised here (then this
    rank returns the error verdict). ``ckpt_dir``: an empty directory that
    every rank sees, for a case with a checkpoint."""
    clock = Clock(timings)
    _ieee_float32()
    try:
        with clock("reference"):
            setup(case, device)
    except Exception as e:  # the reference itself rejects the config
        return invalid(f"reference rejects the config: {error_record(e)['text']}")
    with clock("sharded"):
        obs, error = _run_sharded(case, meshes, target_cls, device, keep=reporter, localize=localize,
                                  ckpt_dir=ckpt_dir, clock=clock)
    obs = meshes.observed(obs)  # what the reporting rank holds (the World seam)
    if error is not None:
        if _documented_refusal(case, error) or target_cls.documented_refusal(case, error):
            return invalid(f"documented: {error['text']}")
        ref_error = next(filter(None, (reference_error(case, d, target_cls)
                                       for d in target_cls.step_devices(case, device))), None)
        if ref_error is not None:
            return invalid(f"reference raises too: {ref_error['text']}", error=error)
        loaded = _check_round_trip(case, obs, device) if obs and obs["loaded"] is not None else []
        if loaded:  # the earliest divergence: a load that changed something explains an error after it
            return finding("checkpoint", loaded, then=error)
        return finding("error_parity", error=error)
    if not reporter:
        return None
    with clock("reference"):
        verdict = check_parity(case, obs, device, target_cls, localize=localize, clock=clock)
    if case.checkpoint and not _fails_before_save(case, verdict):
        with clock("checkpoint"):  # a round trip that changed something explains any divergence after it
            mismatches = _check_round_trip(case, obs, device)
        if mismatches:
            verdict = finding("checkpoint", mismatches)
    return _replica_first(case, obs, verdict)


def _replica_first(case: Case, obs: dict, verdict: dict) -> dict:
    """The replica oracle's finding where replicas diverged before any other
    oracle's first mismatch (a replica that drifted explains what goes wrong
    after it); at the same step the other oracle's stands (its signature names
    what it saw)."""
    found = replica_mismatches_by_step(case, obs)
    if not found:
        return verdict
    step, mismatches = found
    if verdict["status"] == "finding" and verdict.get("first", {}).get("step", -1) <= step:
        return verdict
    return finding("replica", mismatches)


def replica_mismatches_by_step(case: Case, obs: dict) -> tuple[int, list[dict]] | None:
    """(step, mismatches) of the first observation whose replicas differ: a
    step's grads, then its params, state and hyperparameters, and after a
    load (step ``checkpoint.after``, quantities "loaded.*") what it gave."""
    ck = case.checkpoint
    for k, rec in enumerate(obs["steps"]):
        for key in ("replica_grads", "replica_clip", "replica_step"):
            if rec.get(key):
                return k, [{**m, "step": k} for m in rec[key]]
        if ck and k == ck.after and (obs.get("loaded") or {}).get("replica"):
            return k, [{**m, "step": k, "quantity": "loaded." + m["quantity"]} for m in obs["loaded"]["replica"]]
    return None


def _check_round_trip(case: Case, obs: dict, device: str) -> list[dict]:
    """The saved and loaded oracles (checkpoint.py) over a run's observations."""
    rec = obs["steps"][case.checkpoint.after]
    mismatches = check_saved(case, obs["saved"], rec, device) if obs["saved"] else []
    return mismatches + check_loaded(case, obs["loaded"], rec) + check_loaded_loop(case, obs.get("saved_loop"),
                                                                                   obs["loaded"].get("loop"))


def run_bare(case: Case, meshes, target_cls, device: str, reporter: bool, timings: dict | None = None) -> dict | None:
    """The floor ``fuzzshard bench`` measures against: the case's sharded
    training alone, as a user's loop runs it (build, shard, optimizer, then
    per step forward/backward and step), with no observation, reference or
    comparison around it. Its verdict says only whether it ran."""
    clock = Clock(timings)
    try:
        with clock("sharded"):
            if dist.get_rank() < case.world_size:
                with meshes.job(case.world_size):
                    target = target_cls(case, meshes.mesh(case.world_size, case.mesh_shape))
                    model, _ = _sharded_model(meshes, target, case, case.seed, device, flags=())
                    opt = target.optimizer(model)
                    loop = target.loop(opt, model)
                    nothing = dict  # the same steps as a checked run, observing nothing
                    with target.uneven(model, opt, nothing, nothing, lambda rec: None) as runs:
                        mine = [k for k in range(len(case.schedule)) if runs(k)]
                        _steps(meshes, case, target, model, opt, loop, mine, device, keep=False, trace=None,
                               phase=lambda kind, name: None, out=[], observe_grads=nothing, observe_step=nothing,
                               observe_clipped=lambda norm: {})
    except Exception as e:
        return invalid(f"bare run raised: {error_record(e)['text']}")
    return passing() if reporter else None


class Clock:
    """Seconds per part of a case (``timings``: name -> seconds, added up);
    a part inside another is taken out of the outer one, so the parts add up
    to the whole: bench's per-case split."""

    def __init__(self, timings: dict | None):
        self.timings = {} if timings is None else timings
        self.inner = [0.0]  # per open part: the seconds of the parts inside it

    @contextlib.contextmanager
    def __call__(self, part: str):
        t0 = time.perf_counter()
        self.inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            inside = self.inner.pop()
            self.inner[-1] += spent
            self.timings[part] = self.timings.get(part, 0.0) + spent - inside


def _ieee_float32() -> None:
    """float32 matmuls and convolutions in float32 on a GPU too: cuDNN's
    default TF32 keeps 10 mantissa bits, and the tolerances are derived for
    float32's 23 (a TF32 difference between two algorithms is no bug)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _documented_refusal(case: Case, error: dict) -> bool:
    """A strict load is refused by design when the checkpoint lacks state for
    a trainable param (the message names StateDictOptions(strict=False)), or
    when the model state dict misses or adds keys, as load_state_dict(strict=True)."""
    ck = case.checkpoint
    if ck is None or not ck.strict or error["phase"] != "checkpoint load":
        return False
    return bool(ck.missing or ck.unexpected) or error["message"].startswith("Missing optimizer state for parameter")


def _fails_before_save(case: Case, verdict: dict) -> bool:
    return verdict["status"] == "finding" and verdict["first"].get("step", -1) <= case.checkpoint.after


class _Phase:
    """What is running, for the error record: its text, and the kind a
    signature names (said here, so rewording a phase never moves a signature)."""
    name, kind = "shard", "shard"
    # a pool worker's phase file (worker.py): the kind is written at its start, so the driver reads where a
    # rank that hangs or dies was (a hang's or crash's signature names this kind, never a fuzzshard module)
    sink: int | None = None

    def __init__(self) -> None:
        self("shard", "shard")

    def __call__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        if _Phase.sink is not None:
            os.pwrite(_Phase.sink, kind.encode().ljust(8), 0)


def report_phases(path: str) -> None:
    """Write the kind of each phase a case enters at the start of file ``path``
    (a pool worker's, beside its log): what the driver reads of a rank that hangs or dies."""
    _Phase.sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _run_sharded(case: Case, meshes, target_cls, device: str, keep: bool, localize: bool = False,
                 ckpt_dir: str | None = None, clock: Clock | None = None):
    """(observations, None) or (None, error record). Collectives need every rank
    to gather in the same order, so all ranks gather and only ``keep`` stores."""
    clock = clock or Clock(None)
    ck = case.checkpoint
    rank = dist.get_rank()
    phase = _Phase()
    obs = {"steps": [], "saved": None, "loaded": None}
    try:
        if rank < case.world_size:
            with meshes.job(case.world_size):
                with clock("mesh"):
                    target = target_cls(case, meshes.mesh(case.world_size, case.mesh_shape))
                model, obs["init"] = _sharded_model(meshes, target, case, case.seed, device, flags=())
                phase("ctor", "optimizer constructor")
                opt = target.optimizer(model)
                loop = target.loop(opt, model)
                phase("other", "gather initial optimizer state")
                with clock("gathers"):
                    obs["init_state"] = target.optimizer_state(opt, model)  # some optimizers fill state in __init__
                last = ck.after if ck else len(case.schedule) - 1
                obs["steps"] += _train(meshes, case, target, model, opt, loop, range(last + 1), device, keep, localize,
                                       phase, clock)
                if ck:
                    phase("save", "checkpoint save")
                    with clock("checkpoint"):
                        obs["saved"] = target.save(model, opt, ckpt_dir, meshes.group(case.world_size))
                        # the scheduler's and scaler's state beside them (a DCP Stateful or torch.save)
                        obs["saved_loop"] = loop.save(ckpt_dir, ck.kind, meshes.group(case.world_size))
        if ck:
            phase("other", "checkpoint barrier")
            dist.barrier(group=meshes.group(case.ranks))  # the files are complete
            if rank < ck.world_size:
                with meshes.job(ck.world_size):
                    _resume(case, meshes, target_cls, device, keep, localize, ckpt_dir, phase, clock, obs)
        return (obs if keep else None), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # what was observed up to a load that went through stays: a step that raises after it may be its face
        seen = obs if keep and obs["loaded"] is not None else None
        return seen, {**error_record(e), "phase": phase.name, "stage": phase.kind}


def _resume(case: Case, meshes, target_cls, device: str, keep: bool, localize: bool, ckpt_dir: str, phase,
            clock: Clock, obs: dict) -> None:
    """The loading side: a fresh model (another init) and optimizer (every lr
    halved) on the loading world, the load, then the remaining steps; into
    ``obs`` as they are seen (``loaded`` before the steps: a step may raise)."""
    ck = case.checkpoint
    phase("load", "checkpoint load: shard")
    # the loading side's optimizer holds the groups the saved one held
    added_at = case.optim.added_at if case.optim.added_at > ck.after else 0
    lcase = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=ck.mesh_shape,
                                target_options=ck.target_options,
                                optim=dataclasses.replace(case.optim, added_at=added_at))
    with clock("mesh"):
        target = target_cls(lcase, meshes.mesh(ck.world_size, ck.mesh_shape))
    model, fresh = _sharded_model(meshes, target, case, case.seed + 1, device, flags=case.schedule[:ck.after + 1])
    opt = target.optimizer(model, lr_scale=RESUME_LR_SCALE)
    loop = target.loop(opt, model)  # built before the load, as torchtitan builds its schedulers
    phase("load", "checkpoint load")
    with clock("checkpoint"):
        target.load(model, opt, ckpt_dir, meshes.group(ck.world_size))
        loaded_loop = loop.load(ckpt_dir, ck.kind, meshes.group(ck.world_size))
    phase("load", "checkpoint load: gather")
    with clock("gathers"), gather_batch(meshes.batchable) as batch:
        loaded = {"params": target.params(model), "fresh": {n: fresh[n] for n in ck.missing},
                  "state": target.optimizer_state(opt, model), "groups": target.group_hparams(opt)}
        # what a load gives every replica is a copy of one checkpoint: compared whatever the device
        loaded["replica"] = batch.watch({k: loaded[k] for k in ("params", "state", "groups")})
    loaded["loop"] = loaded_loop
    if keep:
        obs["loaded"] = loaded
    obs["steps"] += _train(meshes, lcase, target, model, opt, loop, range(ck.after + 1, len(case.schedule)), device,
                           keep, localize, phase, clock)


def _sharded_model(meshes, target, case: Case, seed: int, device: str, flags) -> tuple:
    """(the sharded model, its initial params): requires_grad as ``case.frozen``
    and then the ``flags`` steps leave it, set after sharding, or before it
    for a target that registers the trainable params when it wraps (DDP)."""
    model = meshes.made_alike(lambda: build_model(case.model, seed, device, getattr(torch, target.build_dtype())))
    init = {n: p.detach().to(torch_dtype(case)).clone() for n, p in model.named_parameters()}

    def set_flags(m):
        target.set_requires_grad(m, case.frozen, False)
        for step in flags:
            target.apply_flags(m, step)

    if target.freeze_before_shard:
        set_flags(model)
    model = target.shard(model)
    if not target.freeze_before_shard:
        set_flags(model)
    return model, init


def _train(meshes, case: Case, target, model, opt, loop, steps, device: str, keep: bool, localize: bool, phase,
           clock: Clock) -> list[dict]:
    """Run schedule steps ``steps``; the record of each when ``keep``."""
    trace = Trace(model, target.full_activation, target.full_activation_grad, target.trace_points(case),
                  replicas=True) if localize and target.localizable else None
    out = []
    loop.every_rank = True  # its found_inf observed as every rank's (the reference compares each with its own)

    compared = target.replica_quantities(device)

    def observe_grads() -> dict:  # collectives over the job, after backward
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            # a fused kernel's divergence is told apart by the layout of the grads it read
            layout = {"noncontig": target.noncontiguous_grads(model)} if case.optim.implementation == "fused" else {}
            rec = {"grads": target.grads(model), "grad_spread": target.grad_spreads(model), **layout}
            rec["replica_grads"] = batch.watch({k: rec[k] for k in ("grads",) if k in compared})
        return rec

    def observe_clipped(norm) -> dict:  # collectives over the job, after clipping
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            rec = {"clipped": target.grads(model), "clip_norm": norm}
            # every rank's copy of the total norm is the same number (a user logs and clips by it)
            rec["replica_clip"] = batch.watch({"clip_norm": {"": norm}} if norm is not None else {})
        return rec

    def observe_step() -> dict:  # collectives over the job, after the step
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            rec = {"params": target.params(model), "state": target.optimizer_state(opt, model),
                   "groups": target.group_hparams(opt), "loop": loop.observe()}
            watched = [k for k in ("params", "state", "groups") if k in compared] + (["loop"] if rec["loop"] else [])
            rec["replica_step"] = batch.watch({k: rec[k] for k in watched})
        return rec

    with target.uneven(model, opt, observe_grads, observe_step, out.append if keep else lambda rec: None) as runs:
        mine = [k for k in steps if runs(k)]
        _steps(meshes, case, target, model, opt, loop, mine, device, keep, trace, phase, out, observe_grads,
               observe_step, observe_clipped)
        if len(mine) < len(steps):  # the target's uneven inputs: the rest of the steps are shadowed on leaving
            phase("other", "joined: shadowing the other ranks' steps (uneven inputs)")
    if trace:
        trace.remove()
    return out


def _steps(meshes, case: Case, target, model, opt, loop, steps, device: str, keep: bool, trace, phase, out: list,
           observe_grads, observe_step, observe_clipped) -> None:
    for k in steps:
        step = case.schedule[k]
        target.apply_flags(model, step)
        if adds_groups_before(case, k):
            phase("other", f"step {k}: add_param_group")
            target.add_groups(opt, model)
        phase("other", f"step {k}: zero_grad")
        opt.zero_grad(set_to_none=step.set_to_none)
        phase("fwdbwd", f"step {k}: forward/backward")
        x, y = meshes.made_alike(lambda: make_batch(case.model, case.seed, k, case.batch, case.seq, device,
                                                    torch_dtype(case)))
        target.scale_loss = loop.scale_loss(k)  # the grad scaler's, else None
        try:
            full_loss = target.forward_backward(model, x, y)
        finally:
            target.scale_loss = None
        traced = trace.take() if trace else None
        if loop.scaler:
            if loop.partial(k):  # an overflow in some grads only: on the ranks that hold its element
                phase("step", f"step {k}: a non-finite grad in {loop.partial(k).param}")
                loop.inject(k, model)
            phase("step", f"step {k}: scaler.unscale_")
            loop.unscale()
        phase("other", f"step {k}: gather grads")
        grads = observe_grads()
        clipped = {}
        if case.clip:
            phase("clip", f"step {k}: clip grads ({case.clip.how})")
            norm = loop.clip(list(model.parameters()))
            phase("other", f"step {k}: gather clipped grads")
            clipped = observe_clipped(norm)
        phase("step", f"step {k}: optimizer.step")
        if loop.used:  # through the scaler, then the scheduler's step
            loop.step(full_loss)
        else:
            opt.step()
        phase("other", f"step {k}: gather params and state")
        rec = {"loss": full_loss.detach().clone(), **grads, **clipped, **observe_step(), "trace": traced}
        if keep:
            out.append(rec)


# ---- the case -------------------------------------------------------------
CASE_JSON = r"""
{
 "batch": 6,
 "checkpoint": {
  "after": 1,
  "kind": "broadcast",
  "mesh_shape": [
   1
  ],
  "missing": [],
  "split": false,
  "strict": false,
  "target_options": {
   "ddp": {
    "broadcast_buffers": false,
    "bucket_cap_mb": 4e-05,
    "find_unused_parameters": true,
    "gradient_as_bucket_view": true,
    "init_sync": false
   }
  },
  "unexpected": false,
  "world_size": 1
 },
 "clip": {
  "error_if_nonfinite": true,
  "foreach": true,
  "how": "two_part",
  "max_norm": 0.001,
  "norm_type": "2"
 },
 "device": "cpu",
 "dtype": "float64",
 "format": 1,
 "frozen": [
  "layers.1.inner.0.bias"
 ],
 "groups": [
  {
   "overrides": {},
   "params": [
    "layers.2.inner.0.weight",
    "layers.2.inner.0.bias",
    "layers.1.inner.0.bias",
    "layers.1.inner.2.bias",
    "layers.1.inner.0.weight",
    "layers.1.inner.2.weight",
    "layers.0.weight",
    "layers.2.inner.1.weight"
   ]
  }
 ],
 "mesh_shape": [
  2
 ],
 "model": {
  "buffer": false,
  "d_in": 1,
  "input": "tokens",
  "layers": [
   {
    "act": "",
    "bias": true,
    "children": [],
    "d_in": 1,
    "d_out": 2,
    "kernel": 1,
    "kind": "embedding"
   },
   {
    "act": "",
    "bias": true,
    "children": [
     {
      "act": "",
      "bias": true,
      "children": [],
      "d_in": 2,
      "d_out": 3,
      "kernel": 1,
      "kind": "linear"
     },
     {
      "act": "relu",
      "bias": true,
      "children": [],
      "d_in": 0,
      "d_out": 0,
      "kernel": 1,
      "kind": "act"
     },
     {
      "act": "",
      "bias": true,
      "children": [],
      "d_in": 3,
      "d_out": 2,
      "kernel": 1,
      "kind": "linear"
     }
    ],
    "d_in": 2,
    "d_out": 2,
    "kernel": 1,
    "kind": "twice"
   },
   {
    "act": "",
    "bias": true,
    "children": [
     {
      "act": "",
      "bias": true,
      "children": [],
      "d_in": 2,
      "d_out": 2,
      "kernel": 1,
      "kind": "linear"
     },
     {
      "act": "",
      "bias": false,
      "children": [],
      "d_in": 2,
      "d_out": 2,
      "kernel": 1,
      "kind": "linear"
     }
    ],
    "d_in": 2,
    "d_out": 2,
    "kernel": 1,
    "kind": "residual"
   }
  ],
  "tie_head": true,
  "unused": false
 },
 "optim": {
  "added_at": 0,
  "added_groups": 0,
  "kwargs": {
   "eps": 1e-06,
   "foreach": true,
   "lr": 0.1,
   "maximize": true,
   "rho": 0.9,
   "weight_decay": 0.01
  },
  "name": "Adadelta",
  "named": true,
  "tensor_lr": "1d"
 },
 "schedule": [
  {
   "freeze": [],
   "set_to_none": true,
   "unfreeze": []
  },
  {
   "freeze": [],
   "set_to_none": false,
   "unfreeze": []
  }
 ],
 "seed": 12449,
 "seq": 2,
 "target": "ddp",
 "target_options": {
  "ddp": {
   "bucket_cap_mb": 4e-05,
   "find_unused_parameters": true
  },
  "gate": "layers.2",
  "hook": {
   "feedback": false,
   "min_rate": 2.0,
   "name": "powersgd",
   "rank": 1,
   "start": 1,
   "warm": false
  },
  "microbatches": 3
 },
 "world_size": 2
}
"""
TARGET = DDPTarget


def _plugin_shim() -> None:
    """A --plugin file registers its optimizer through ``fuzzshard.plugin``:
    here that registers into this script's own kernel, fuzzshard or not."""
    import types

    def optimizer(cls, kwargs=None, name=None, elementwise=True):
        USER_OPTIMIZERS[name or cls.__name__] = cls
        return cls

    def model(build, sizes=None, name=None, tokens=False):
        USER_MODELS[name or build.__name__] = build
        return build

    def parallelism(parallelize, options=None, name=None, models=(), dp_dims=None, checkpoints=True):
        if "USER_PARALLELISMS" in globals():  # this script's target is a parallelism
            USER_PARALLELISMS[name or parallelize.__name__] = (parallelize, dp_dims)
        return parallelize

    shim = types.ModuleType("fuzzshard.plugin")
    shim.optimizer, shim.model, shim.parallelism = optimizer, model, parallelism
    package = sys.modules.get("fuzzshard") or types.ModuleType("fuzzshard")
    package.plugin = shim
    sys.modules["fuzzshard"], sys.modules["fuzzshard.plugin"] = package, shim


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--setup", help="a Python file run before the case (a patch of torch, e.g. a planted bug)")
    args = ap.parse_args()
    if args.setup:
        _plugin_shim()
        exec(compile(open(args.setup).read(), args.setup, "exec"), {"__name__": "__fuzzshard_setup__", "__file__": args.setup})
    torch.set_num_threads(1)
    case = Case.from_json(CASE_JSON)
    if int(os.environ.get("WORLD_SIZE", "0")) != case.ranks:
        print(f"run me with: torchrun --nproc-per-node {case.ranks} {sys.argv[0]}", file=sys.stderr)
        return 2
    import shutil
    import tempfile
    from datetime import timedelta

    device = "cpu"
    if case.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if case.device == "cuda" else "gloo", timeout=timedelta(seconds=120))
    meshes = Meshes(case.ranks, case.device)
    rank = dist.get_rank()
    ckpt = [tempfile.mkdtemp(prefix="fuzzshard-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)  # one directory every rank sees (one machine)
    try:
        verdict = run_case(case, meshes, TARGET, device, reporter=rank == 0, ckpt_dir=ckpt[0])
    finally:  # rank 0 returns last from the loading side's collectives
        if rank == 0:
            shutil.rmtree(ckpt[0], ignore_errors=True)
    if verdict is None or verdict["status"] == "pass":
        if rank == 0:
            print("PASS: the sharded run matches the reference")
        dist.destroy_process_group()
        return 0
    shown = {k: v for k, v in verdict.items() if k not in ("mismatches",)}
    print(f"rank {rank}: {verdict['status'].upper()}:", json.dumps(shown, indent=1, default=str))
    if verdict["status"] == "invalid":
        return 0
    return 1


if __name__ == "__main__":
    code = _main()
    # Skip interpreter finalization: with a DeviceMesh alive, gloo's run-loop
    # thread can abort the process there (a torch teardown race, not the case).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
