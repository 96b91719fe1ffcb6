"""Target ``zero``: ``torch.distributed.optim.ZeroRedundancyOptimizer``.

Every rank holds the whole model and trains on its slice of the global batch.
Grads are averaged by DDP (``ddp`` in the target options, with its own
flags) or by hand (an all-reduce per grad). ZeRO partitions the params
greedily by size; each rank steps its partition with the inner optimizer and
broadcasts the result. ``target_options``:
  - ``ddp``: {} for hand-averaged grads, else DDP's kwargs (broadcast_buffers,
    find_unused_parameters, gradient_as_bucket_view, static_graph);
  - ``bucket_view``: ``parameters_as_bucket_view``;
  - ``consolidate_to``: the rank that ``consolidate_state_dict(to=)`` sends the
    checkpoint to;
  - ``local`` (loading side only): resume with the plain torch.optim optimizer
    (cross-loading ZeRO's state into the local optimizer);
  - ``uneven``: per rank, how many schedule steps it runs; the loop runs
    under ``Join`` and a rank out of steps shadows the others' (DDP only);
  - ``generator_groups``: each param group's params given as a one-shot
    iterator, which torch.optim accepts (a known trap for wrappers that
    iterate them twice).
What must hold beyond training parity: every rank's replica of every param
and grad is the same, and the partitions cover every param exactly once.
The checkpoint is ``consolidate_state_dict`` + ``state_dict()``, which must
equal the local optimizer's ``state_dict()``; ``load_state_dict`` of it on
every rank of another world size must restore it.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..dropout import has_dropout
from ..state_io import as_tensor
from ..ac import AC_HOWS, AC_REENTRANT, apply_ac
from ..model import loss_fn, named_params
from ..moe import moe_configs_of
from ..optim import build_optimizer, optimizer_class, param_order
from .base import Spec, Target


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), model=None, loading: bool = False,
                 **_) -> dict:
    """Grads averaged by hand or by DDP (with its flags), the bucket view, the
    rank the state is consolidated to; a loading side may resume with the
    local optimizer."""
    import hypothesis.strategies as st

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


def joinable(case) -> bool:
    """Join applies with DDP averaging the grads (its join hook shadows the
    all-reduce), every trainable param used (a joined rank cannot tell an
    unused param's zero grad from a real one), no checkpoint, no param groups
    added and nothing frozen mid-run (a joined rank runs no schedule), no MoE."""
    return ("ddp" in case.target_options and case.world_size > 1 and len(case.schedule) > 1
            and case.checkpoint is None and not case.model.unused and not case.optim.added_groups
            and not any(s.freeze or s.unfreeze for s in case.schedule)
            # an MoE's load balancing runs collectives each step (kernel/moe.py) that a joined rank does not shadow
            and not moe_configs_of(case.model))


def draw_late_options(draw, case) -> dict:
    """Once the groups added later are drawn: rarely (and never when shrunk)
    each group's params as a one-shot iterator (``generator_groups``, a known
    trap); else, where ``joinable``, now and then uneven inputs under Join:
    rank r runs the first counts[r] steps, one rank all of them. The loop,
    drawn after, then takes no clip, scheduler or scaler (``check`` refuses
    them: strategies' draws ask the rule before each loop feature)."""
    import hypothesis.strategies as st

    out = dict(case.target_options)
    n_steps, world = len(case.schedule), case.world_size
    if draw(st.integers(0, 7)) == 7:
        out["generator_groups"] = True
    elif joinable(case) and draw(st.integers(0, 3)) == 3:
        counts = [draw(st.integers(1, n_steps)) for _ in range(world)]
        counts[draw(st.integers(0, world - 1))] = n_steps
        out["uneven"] = counts
    return out


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """consolidate_to names a rank of the world; uneven holds a step count per
    rank, one of them every step."""
    world = math.prod(mesh_shape)
    if options.get("consolidate_to", 0) >= world:
        del options["consolidate_to"]
    if "uneven" in options:
        counts = (options["uneven"] + [n_steps] * world)[:world]
        if max(counts) != n_steps:
            counts[-1] = n_steps
        options["uneven"] = counts
    return options


def check(case) -> str | None:
    uneven = case.target_options.get("uneven")
    if uneven and (case.clip or case.lr_scheduler or case.scaler):
        # ZeroJoinHook.main_hook calls zero.step() itself on a joined rank: no clip, no scaler, no scheduler there
        return "uneven inputs under Join: a joined rank's ZeRO join hook steps without the loop (clip, scaler, lr)"
    if uneven is not None and (len(uneven) != case.world_size or max(uneven) != len(case.schedule) or min(uneven) < 1):
        return (f"uneven inputs {uneven}: want one step count in 1..{len(case.schedule)} per rank of "
                f"{case.world_size}, one of them {len(case.schedule)}")
    if uneven and has_dropout(case.model):
        return "dropout with uneven inputs under Join: a joined rank's shadowed steps are not replayed"
    return None


def coverage(case) -> dict:
    """The training loop features a case used (fsdp1.loop_coverage), with DDP or hand-averaged grads."""
    from .fsdp1 import loop_coverage

    return loop_coverage(case, "DDP" if "ddp" in case.target_options else "hand-averaged")


CHECKPOINT_FILE = "zero.pt"


class ReplicasDiverged(AssertionError):
    """Ranks that must hold the same tensor hold different ones."""


class PartitionBroken(AssertionError):
    """ZeRO's partitions do not cover every param exactly once."""


class GroupsLost(AssertionError):
    """ZeRO's param_groups lack params it was given (torch.optim keeps them all)."""


class _Shadow(Joinable):
    """A Joinable whose join hook runs ``fn``: a joined rank's part in
    collectives the training loop runs between DDP's and ZeRO's."""

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


def ac_rule(options: dict, how: str) -> str | None:
    """DDP's docs: with use_reentrant=True it works only without unused params and with each layer checkpointed
    at most once; "use_reentrant=False (recommended) ... without any limitations". Reentrant forms are drawn
    only without DDP (the hand all-reduce)."""
    if how in AC_REENTRANT and "ddp" in options:
        return f"activation checkpointing {how!r} under DDP (reentrant: DDP's documented limits)"
    return None


class ZeroTarget(Target):
    name = "zero"
    # DDP records the params that require grad when it wraps
    spec = Spec(moe={"whole_batch": False}, options=draw_options, data_parallel=True, flat_mesh=True, add_param_group=True,
                late_options=draw_late_options,
                checkpoint_kinds={"consolidate": "consolidate_state_dict + state_dict(), torch.save; "
                                                 "load_state_dict on every rank"},
                flags_fixed=lambda options: "ddp" in options, check=check, fit_options=fit_options,
                component="ZeroRedundancyOptimizer", coverage=coverage,
                # the loop: full grads on every rank (DDP's or the hand all-reduce) before the step, so
                # torch.nn.utils' clips and a plain GradScaler see what a local model's would; a scheduler
                # moves ZeRO's param_groups, which its step syncs into the local optimizer
                clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True,
                ac=tuple(AC_HOWS), ac_rule=ac_rule, dropout="replay")
    freeze_before_shard = True  # DDP registers the params that require grad when it wraps
    # ZeroRedundancyOptimizer has no _step_supports_amp_scaling (its step could not pass found_inf on to
    # the local optimizer): GradScaler skips its whole step on an inf, whatever the local optimizer is
    amp_scaling_step = False

    @classmethod
    def reference_batch(cls, case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """With uneven inputs only the ranks that still run step k contribute
        their slices, and DDP averages over the whole world: the grad of the
        sum over active ranks of their mean loss / W."""
        counts = case.target_options.get("uneven")
        if not counts:
            return x, y, 1.0
        per = x.shape[0] // len(counts)
        active = [r for r, n in enumerate(counts) if n > k]
        pick = torch.cat([torch.arange(r * per, (r + 1) * per) for r in active]).to(x.device)
        return x[pick], y[pick], len(active) / len(counts)

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        self.group = mesh.get_group()
        self.ddp = None
        self.late_added = False  # the case's mid-run add_param_group calls are done
        self.joined = False  # out of uneven inputs: inside Join's shadowing loop

    @property
    def localizable(self) -> bool:
        """Traces gather activations across ranks: a joined rank has none to give."""
        return not self.counts

    @property
    def counts(self) -> list[int] | None:
        """Uneven inputs: the number of steps each rank runs (the rest under Join)."""
        return self.case.target_options.get("uneven")

    @contextlib.contextmanager
    def uneven(self, model: nn.Module, opt, observe_grads, observe_step, record):
        """Uneven inputs, as documented for DDP and ZeRO: the training loop runs
        inside ``Join([ddp, ..., zero, ...])``. A rank out of inputs joins: DDP's
        join hook shadows the grad all-reduce (the comm hook below makes its
        result this rank's grads, which ZeRO's join hook requires to be "properly
        set"), ZeRO's join hook steps this rank's partition and broadcasts it,
        and fuzzshard's own hooks shadow the loop's loss all-reduce and its
        observation gathers, in the loop's order, recording each step."""
        if not self.counts:
            yield lambda k: True
            return
        pending = {}

        def after_backward():  # the loop's loss all-reduce (a joined rank adds 0), then its grad gathers
            loss = torch.zeros((), dtype=next(model.parameters()).dtype, device=next(model.parameters()).device)
            dist.all_reduce(loss, group=self.group)
            pending.update({"loss": loss / self._world(), **observe_grads()})

        def after_step():
            record({**pending, **observe_step(), "trace": None})

        mine = self.counts[dist.get_rank(self.group)]
        with Join([self.ddp, _Shadow(after_backward, self.group, model), opt, _Shadow(after_step, self.group, model)]):
            yield lambda k: k < mine
            self.joined = True

    def _allreduce_setting_joined_grads(self, state, bucket):
        """DDP's averaging as a comm hook (divide by the world size, all-reduce).
        On a joined rank DDP runs it on zeros and drops the result; here the
        result, bitwise the active ranks' grads, becomes this rank's grads."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        fut = allreduce_hook(self.group, bucket)
        if not self.joined:
            return fut

        def set_grads(done):
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                p.grad = g.detach().clone()
            return done.value()

        return fut.then(set_grads)

    @property
    def local(self) -> bool:
        return bool(self.case.target_options.get("local"))

    def shard(self, model: nn.Module) -> nn.Module:
        self.comm_device = next(model.parameters()).device
        apply_ac(model, self.case.target_options)  # activation checkpointing before DDP wraps (kernel/ac.py)
        ddp = self.case.target_options.get("ddp")
        if ddp is not None:
            from torch.nn.parallel import DistributedDataParallel

            device = next(model.parameters()).device
            device_ids = None if device.type == "cpu" else [device]
            self.ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=self.group, **ddp)
            if self.counts:
                self.ddp.register_comm_hook(None, self._allreduce_setting_joined_grads)
        return model  # the plain module: its FQNs; the forward goes through DDP

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        if self.local:
            return build_optimizer(model, self.case, lr_scale)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = functools.partial(ZeroRedundancyOptimizer, optimizer_class=optimizer_class(self.case.optim.name),
                                 process_group=self.group,
                                 parameters_as_bucket_view=self.case.target_options.get("bucket_view", False))

        def construct(groups, **kw):
            if self.case.target_options.get("generator_groups"):
                # each group's params as a one-shot iterator: torch.optim takes any iterable
                # there (it makes a list), so ZeRO must train the same params
                groups = [{**g, "params": iter(g["params"])} for g in groups]
            return zero(groups, **kw)

        opt = build_optimizer(model, self.case, lr_scale, construct=construct)
        self._check_groups(opt, model)
        self._check_partition(opt, model)
        return opt

    def add_groups(self, opt, model: nn.Module) -> None:
        """ZeRO repartitions: the new partitions must still cover every param once."""
        super().add_groups(opt, model)
        self.late_added = True
        if self.local:
            return
        self._check_groups(opt, model)
        self._check_partition(opt, model)

    def _check_groups(self, opt, model: nn.Module) -> None:
        names = {id(p): n for n, p in named_params(model).items()}
        held = {names[id(p)] for g in opt.param_groups for p in g["params"]}
        lost = [n for n in self._given() if n not in held]
        if lost:  # the first line is the signature's: no names in it
            raise GroupsLost(f"the param groups lack {len(lost)} of the params given to the constructor\n{lost}")

    def _given(self) -> list[str]:
        """The FQNs given to the optimizer so far (constructor and add_param_group)."""
        given = self.case.groups
        if self.case.optim.added_at and not self.late_added:
            given = given[:len(given) - self.case.optim.added_groups]
        return [n for g in given for n in g.params]

    def _check_partition(self, opt, model: nn.Module) -> None:
        """Every param of every group in exactly one rank's local optimizer."""
        names = {id(p): n for n, p in named_params(model).items()}
        mine = [names[id(p)] for g in opt.optim.param_groups for p in g["params"]]
        owned = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(owned, mine, group=self.group)
        count = {n: 0 for n in self._given()}
        for rank_names in owned:
            for n in rank_names:
                count[n] = count.get(n, 0) + 1
        wrong = {n: c for n, c in count.items() if c != 1}
        if wrong:  # the first line is the signature's: no names in it
            orphans = sum(1 for c in wrong.values() if c == 0)
            raise PartitionBroken(f"the partitions leave {orphans} param(s) without an owner and give "
                                  f"{len(wrong) - orphans} param(s) several\nowners per param: {wrong}")

    def _world(self) -> int:
        return dist.get_world_size(self.group)

    def batch_groups(self) -> list:
        return [self.group]

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the batch; grads averaged over the ranks."""
        world, rank = self._world(), dist.get_rank(self.group)
        per = x.shape[0] // world
        loss = loss_fn((self.ddp or model)(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        self.backward(loss)
        if self.ddp is None:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad.div_(world)
        full = loss.detach().clone()
        dist.all_reduce(full, group=self.group)
        return full / world

    def full(self, t: torch.Tensor, what: str = "tensor", fqn: str = "") -> torch.Tensor:
        """This rank's tensor, once every rank is seen to hold the same one."""
        # on the group's device: NCCL gathers no CPU tensor (Adam's ``step`` lives on the CPU)
        x = t.detach().contiguous().to(self.comm_device)
        replicas = [torch.empty_like(x) for _ in range(self._world())]
        dist.all_gather(replicas, x, group=self.group)
        for r, other in enumerate(replicas):
            # bitwise: all-reduce and broadcast give every rank the same bits
            if not torch.allclose(other, replicas[0], rtol=0.0, atol=0.0, equal_nan=True):
                diff = (other - replicas[0]).abs().max().item()
                raise ReplicasDiverged(f"the replicas of a {what} differ: rank {r} vs rank 0, max abs diff {diff:.3g}"
                                       f"\n{what} {fqn}")  # names off the first line: it makes the signature
        return t

    def params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: self.full(p, "param", n).detach().clone() for n, p in named_params(model).items()}

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else self.full(p.grad, "grad", n).detach().clone()
                for n, p in named_params(model).items()}

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        """Each rank's local optimizer holds the state of its partition only."""
        if self.local:
            return super().optimizer_state(opt, model)
        names = {id(p): n for n, p in named_params(model).items()}
        mine = {names[id(p)]: {k: as_tensor(v).detach().cpu().clone()
                               for k, v in sorted(opt.optim.state[p].items())}
                for g in opt.optim.param_groups for p in g["params"] if opt.optim.state.get(p)}
        parts = [None] * self._world()
        dist.all_gather_object(parts, mine, group=self.group)
        return {n: st for part in parts for n, st in part.items()}

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        """consolidate_state_dict(to=r), state_dict() on rank r, torch.save;
        the reporting rank reads it back, keyed by FQN for the oracle."""
        to = self.case.target_options.get("consolidate_to", 0)
        opt.consolidate_state_dict(to=to)
        rank = dist.get_rank(self.group)
        file = os.path.join(path, CHECKPOINT_FILE)
        if rank == to:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, file)
        dist.barrier(group=self.group)
        if rank != 0:
            return None
        saved = torch.load(file, map_location="cpu")
        order = param_order(self.case)
        osd = saved["optim"]
        by_fqn = {"state": {order[i]: st for i, st in osd["state"].items()},
                  "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
        return {"model": saved["model"], "optim": by_fqn}

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        """Every rank loads the whole consolidated state: ZeRO keeps its partition."""
        saved = torch.load(os.path.join(path, CHECKPOINT_FILE), map_location="cpu")  # the load APIs place it
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
