"""The target interface, with the defaults most targets keep.

A target turns a plain model into its sharded form, builds the optimizer
under test, runs a forward/backward, and turns whatever it shards back into
full plain tensors for the oracles. Everything a target does not override
falls back to the plain torch.optim optimizer over ``model.named_parameters()``
and the state-dict round trip of ``torch.distributed.checkpoint``.
Every method that gathers is a collective: all ranks of the job call it in
the same order.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ...case import Case
from ..ac import ac_problem
from ..dropout import dropout_problem
from ..gather import owned_copy
from ..moe import moe_problem
from ..state_io import async_save_problem, load, save
from ..model import loss_fn, named_params, param_shapes
from ..loop import Loop
from ..optim import add_late_groups, build_optimizer, group_hparams, state_by_fqn


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
    # (options, kept) -> the options on a mesh of only the ``kept`` dims of the case's (a tuple of mesh dims, in
    # order; the reducer's world edits keep some of a mesh's dims, then fit_options fits the sizes): what names
    # mesh dims by position; given a copy, it may change it. None: the options stay as they are
    project_options: Callable | None = None
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
    # dropout in its models (kernel/dropout.py): "" none drawn; "replay": each rank's masks are drawn on plain
    # tensors from its own seed and the reference replays them; "replica": drawn on DTensors or TP's shards,
    # where torch promises no mask equal to the unsharded op's: loss and grads not compared, the rest is
    dropout: str = ""
    # activation checkpointing (kernel/ac.py): the forms it draws (of ac.AC_HOWS; () none), and (options, how) ->
    # why torch does not support that form under these options, or None
    ac: tuple = ()
    ac_rule: Callable | None = None
    # (case) -> how it shards a tied weight (model.tie_uses: one param, two modules), a few words ("" untied): the
    # tie line of ``show``, a "tied weights" coverage cell, the model dimension's counted cell (session/schedule.py)
    tie: Callable | None = None
    # the mixture-of-experts layers it takes (kernel/moe.py; strategies/models.py moe_configs' arguments): None,
    # none; {"whole_batch": every forward sees the whole global batch (capacity-factor dropping may be drawn),
    # "microbatched": a rank runs its slice in microbatches (no batch-wise aux loss), "aux": False (no aux loss),
    # "bias": False (no routing bias), "local": its MoE sees DTensor activations and runs on full plain copies
    # (MoE._forward_local: no AC of a module inside it, kernel/ac.py ac_moe_problem), "odds": one topology or
    # decoder in this many has one (strategies/models.py MOE_ODDS where it says none; 0: only with --models moe,
    # which puts one in every case)}
    moe: dict | None = None
    # a corner of its own options that a timed session's schedule steers toward (session/schedule.py, "option
    # corner"), where a drawn mesh allows it: None, none; {"option": the target option a case in it has on,
    # "mesh_dims": the dims of the meshes that allow it, "experts_over": (where its MoE is optional) the mesh dim an
    # aimed case's MoE experts divide over, "checkpoint": False where the corner takes no checkpoint, "batch":
    # (mesh_shape) -> the batch sizes an aimed case draws from (a target that is not data_parallel)}. A case aimed
    # there (drawn after the mesh, off first: it shrinks to today's draw) draws the option on (and that MoE); its
    # options and late options are drawn with aim=True
    corner: dict | None = None


def case_problem(case: Case, target: type | None) -> str | None:
    """The validity rules said beside the kernel code they guard (Case.check asks them through targets.py, in
    this order): a scaler's overflow in a param the model has, where an async save can run (state_io.py),
    dropout (dropout.py), then, for a known ``target`` (its class), activation checkpointing (ac.py), MoE
    (moe.py) and the target's own refusals (its Spec's ``check``); None where they take the case."""
    at = case.scaler.overflow_at if case.scaler else None
    if at:
        shape = param_shapes(case.model).get(at.param)
        if shape is None:
            return f"an overflow in {at.param}'s grad: the model has no such param"
        if not 0 <= at.index < max(math.prod(shape), 1) or at.value not in ("inf", "-inf", "nan"):
            return (f"an overflow of {at.value!r} at element {at.index} of {at.param} "
                    f"({math.prod(shape)} elements; inf, -inf or nan)")
    problem = async_save_problem(case) or dropout_problem(case)
    if problem or target is None:
        return problem
    spec = target.spec
    sides = [("", case.target_options)] + ([("checkpoint ", case.checkpoint.target_options)] if case.checkpoint else [])
    for what, options in sides:
        problem = ac_problem(case, options, spec)
        if problem:
            return what + problem
    return moe_problem(case, spec, target.microbatches) or (spec.check(case) if spec.check else None)


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

    @classmethod
    def state_allowance(cls, case: Case, k: int, state: dict) -> dict:
        """{fqn: state name -> an elementwise allowance or None} for the reference's optimizer state after step
        ``k``, where the target keeps it otherwise (fsdp2: a low-bit optimizer's quantized state); none here."""
        return {}

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
    def held_grad_scale(cls, case: Case, k: int) -> float:
        """What a grad held from the steps before (a param in no param group: zero_grad leaves it) counts for
        in step k's reduced grad: all of it, unless the target reduces less of it (ddp's Join)."""
        return 1.0

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

    @classmethod
    def dropout_world(cls, options: dict, world: int) -> int:
        """How many ranks draw dropout masks each on its own slice of the batch (the reference replays each
        one's draws, kernel/dropout.py): the world where each rank trains on its slice, else 1 (every rank
        runs the whole batch, from the same seed)."""
        return world if cls.spec.data_parallel else 1

    def dropout_rank(self) -> int:
        """Which of those ranks' seeds this rank draws its masks from."""
        return self.dp_rank() if self.dropout_world(self.case.target_options, self.case.world_size) > 1 else 0

    def dp_size(self) -> int:
        return math.prod(self.mesh.size(dim) for dim in self.dp_dims)

    def batch_groups(self) -> list:
        """The process groups the global batch is split over, each rank training on its slice (none where
        every rank runs the whole batch): an MoE's load-balancing counts are summed over them (kernel/moe.py)."""
        return []

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

    def round_trip_mismatches(self) -> list[dict]:
        """Collective over the loading job, after its steps: the target's own checks of what the checkpoint
        carried beyond the model and optimizer (ddp's PowerSGD state), every rank's mismatches; none here."""
        return []
