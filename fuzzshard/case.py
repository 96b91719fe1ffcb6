"""The Case: one fuzzed training setup as frozen, JSON-round-trippable data.

Nothing but a Case crosses a process boundary. Everything a run needs to be
rebuilt bit for bit is in it, seeds included (Hypothesis does not seed torch).
Free-form values (optimizer kwargs, target options) hold JSON-native types
only (lists, not tuples), so ``Case.from_json(c.to_json()) == c`` always.
"""
from __future__ import annotations

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
    activations: act (``act`` names it); dropout (``nn.Dropout(p)``: a mask drawn
    each forward, kernel/dropout.py says from which seed); composites: seq,
    residual (x + f(x)), twice (f(f(x)), one submodule called twice in a forward);
    moe (a d -> d mixture-of-experts layer, kernel/moe.py, configured by ``moe``).
    """

    kind: str
    d_in: int = 0
    d_out: int = 0
    bias: bool = True
    act: str = ""
    kernel: int = 1
    children: tuple[Layer, ...] = ()
    # dropout's probability; left out of the JSON when unset, so every other layer reads as before
    p: float = field(default=0.0, metadata={"omit_default": True})
    # kind "moe": its config (kernel/moe.py MOE_KEYS); left out of the JSON elsewhere
    moe: dict[str, Any] = field(default_factory=dict, metadata={"omit_default": True})


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
        param groups, the loop's features against the schedule; then the kernel's rules, said beside the code
        they guard and asked through the target registry (targets.py ``case_problem``; kernel/targets/base.py):
        where an async save can run, dropout, activation checkpointing, MoE, and the target's own refusals
        (its Spec's ``check``, e.g. ZeRO's uneven inputs under Join with a clip, scaler or LR scheduler)."""
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
        if self.scaler and self.scaler.overflow_at and not 0 <= self.scaler.overflow_at.step < len(self.schedule):
            at = self.scaler.overflow_at
            raise CaseError(f"an overflow in {at.param}'s grad at step {at.step}: the schedule has {len(self.schedule)} steps")
        if self.checkpoint and not 0 <= self.checkpoint.after < len(self.schedule):
            raise CaseError(f"checkpoint after step {self.checkpoint.after}: the schedule has {len(self.schedule)} steps")
        from . import targets  # the rules said beside the code they guard: the kernel's and the target's own

        problem = targets.case_problem(self)
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


_SHAPES: dict = {}


def _shape(tp) -> tuple:
    """What _from_jsonable asks of a type, once per type (typing.get_origin, dataclasses.fields and the type
    hints cost a few milliseconds of every case a worker reads, asked anew of each value): (origin, the
    Union's non-None member or None, the dataclass's ((name, hint, required), ...) and field names or None)."""
    try:
        return _SHAPES[tp]
    except (KeyError, TypeError):  # TypeError: an unhashable annotation (never cached)
        pass
    origin = typing.get_origin(tp)
    member = fields = names = None
    if origin in (typing.Union, types.UnionType):  # X | None
        (member,) = [a for a in typing.get_args(tp) if a is not type(None)]
    elif dataclasses.is_dataclass(tp):
        hints = _type_hints(tp)
        fields = tuple((f.name, hints[f.name], f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(tp))
        names = frozenset(f[0] for f in fields)
    out = (origin, member, fields, names)
    try:
        _SHAPES[tp] = out
    except TypeError:
        pass
    return out


def _from_jsonable(tp: Any, value: Any, where: str) -> Any:
    """Rebuild a value of type ``tp`` from JSON data, with a clear error path."""
    origin, member, fields, names = _shape(tp)
    if member is not None:  # X | None
        if value is None:
            return None
        return _from_jsonable(member, value, where)
    if fields is not None:
        if not isinstance(value, dict):
            raise CaseError(f"{where}: expected an object, got {type(value).__name__}")
        unknown = set(value) - names
        if unknown:
            raise CaseError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for name, hint, required in fields:
            if name in value:
                kwargs[name] = _from_jsonable(hint, value[name], f"{where}.{name}")
            elif required:
                raise CaseError(f"{where}: missing field {name!r}")
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
