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
from __future__ import annotations

import functools
import math
import os

import torch

from ..case import Case, Clip, LRScheduler

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
