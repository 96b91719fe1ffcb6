"""Target ``sharded_optim``: ``ShardedOptimizer`` over ``ShardedTensor`` params.

``shard_parameter`` turns the params the Case names into ShardedTensors
(``ChunkShardingSpec`` on a drawn dim, over a drawn list of ranks: chunks may
be uneven, and ranks may hold no chunk); the rest stay dense beside them.
``ShardedOptimizer`` over ``named_params_with_sharded_tensor(model)`` then
steps every rank's local shards and the dense params with the inner
torch.optim optimizer. ShardedTensor has no autograd of its own, so the
forward runs on full copies gathered with ``ShardedTensor.gather`` and each
rank takes its shards' slices of the full grads: what is under test is the
sharding, the gather and the optimizer step on local shards.
``target_options``: ``shard``: {fqn: {"dim": d, "ranks": [r, ...]}} (the
ranks that hold the chunks, in chunk order).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from ..state_io import as_tensor
from ..model import WRAPPERS, loss_fn, plain_fqn, submodule
from ..optim import optimizer_class, optimizer_kwargs
from ..ac import AC_HOWS, ac_how, apply_ac
from .base import Spec, Target


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **_) -> dict:
    """Which params become ShardedTensors, on which dim, and the ranks that
    hold the chunks, in chunk order: mostly one chunk per rank in any order
    (ChunkShardingSpec.shard scatters one chunk to each rank), now and then any
    list (a rank with two chunks or none: known errors). A tied param stays
    dense: shard_parameter re-registers it on one module only."""
    import hypothesis.strategies as st

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


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """Each param's chunks on the ranks the world still has; a param left with none stays dense."""
    if "shard" in options:
        world = math.prod(mesh_shape)
        shards = {n: {**s, "ranks": [r for r in s["ranks"] if r < world]} for n, s in options["shard"].items()}
        options["shard"] = {n: s for n, s in shards.items() if s["ranks"]}
    return options


def coverage(case) -> dict:
    """The training loop features a case used (fsdp1.loop_coverage)."""
    from .fsdp1 import loop_coverage

    return loop_coverage(case)


def _owner(model: nn.Module, module_name: str, attr: str) -> nn.Module:
    """The module that holds param ``attr`` in its own ``_parameters``: ``submodule`` answers a CheckpointWrapper
    (AC's wrapper forms) for the module it wraps, and shard_parameter on the wrapper fails (its hasattr sees the
    wrapped module's param through the wrapper's __getattr__, its register_parameter then refuses the name:
    "attribute 'weight' already exists"); the param is re-registered where it lives."""
    mod = submodule(model, module_name)
    while attr not in mod._parameters and any(w in mod._modules for w in WRAPPERS):
        mod = next(mod._modules[w] for w in WRAPPERS if w in mod._modules)
    return mod


class ShardedParamsListed(AssertionError):
    """named_params_with_sharded_tensor lists other params than the module has."""


class GatherMismatch(AssertionError):
    """ShardedTensor.gather returns other values than the local shards hold."""


def _is_sharded(t) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(t, ShardedTensor)


def _shard_slices(md) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))


class ShardedOptimTarget(Target):
    name = "sharded_optim"
    # ShardedOptimizer takes one flat set of params, steps each local shard on its own
    # the loop: a scheduler (ShardedOptimizer's param_groups are its local optimizer's); ShardedGradScaler
    # (found_inf all-reduced over the group: each rank unscales only its shards' grads). No clip: a
    # ShardedTensor is no Parameter (model.parameters() leaves it out) and torch has no clip for its grads
    spec = Spec(moe={"whole_batch": True}, options=draw_options, single_group=True, elementwise_only=True, flat_mesh=True, fit_options=fit_options,
                component="ShardedOptimizer", coverage=coverage, lr_scheduler=True, scaler=True, ac=tuple(AC_HOWS),
                dropout="replay")  # every rank runs the whole batch: one replay, from the same seed
    localizable = False  # the forward runs on gathered copies, not on the module's params
    amp_scaling_step = False  # ShardedOptimizer takes no found_inf: GradScaler skips its whole step on an inf

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        self.group = mesh.get_group()

    def grad_scaler(self, **kwargs):
        """ShardedGradScaler over the target's group: each rank's optimizer
        holds its own shards, so found_inf must be all-reduced (a plain
        GradScaler would let a rank whose shards hold no inf step alone)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.mesh.device_type, process_group=self.group, **kwargs)

    def shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed._shard.api import shard_parameter
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec

        # activation checkpointing first (kernel/ac.py): apply_activation_checkpointing counts the params it
        # wraps (numel), which a ShardedTensor does not answer
        apply_ac(model, self.case.target_options)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for fqn, spec in sorted(self.case.target_options.get("shard", {}).items()):
            module_name, _, attr = fqn.rpartition(".")
            placements = [f"rank:{r}/{device}" for r in spec["ranks"]]
            shard_parameter(_owner(model, module_name, attr), attr, ChunkShardingSpec(spec["dim"], placements),
                            process_group=self.group)
        return model

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        from torch.distributed._shard.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor

        listed = list(named_params_with_sharded_tensor(model))
        names = [n for n, _ in listed]
        plain = [n for n, _ in model.named_parameters()]
        if sorted(names) != sorted(plain):
            raise ShardedParamsListed(f"named_params_with_sharded_tensor lists {names}, the module has {plain}")
        params = {plain_fqn(n): p for n, p in listed}  # a CheckpointWrapper in between: plain FQNs
        (group,) = self.case.groups  # ShardedOptimizer takes one flat set of params
        kwargs = {**self.case.optim.kwargs, **group.overrides}
        return ShardedOptimizer({n: params[n] for n in group.params}, optimizer_class(self.case.optim.name),
                                **optimizer_kwargs(kwargs, self.case.optim.tensor_lr, self.case.device, lr_scale))

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every rank runs the whole batch on full copies of the sharded params;
        each local shard then gets its slice of the full grad."""
        sharded = {n: p for n, p in model.named_parameters() if _is_sharded(p)}
        copies = {n: self.full(p).detach().requires_grad_(p.requires_grad) for n, p in sharded.items()}
        if ac_how(self.case.target_options):
            # a checkpointed module recomputes its forward in backward: the copies stay the module's params
            # until then (functional_call's context, around the backward too)
            from torch.nn.utils.stateless import _reparametrize_module

            with _reparametrize_module(model, copies):
                loss = loss_fn(model(x), y)
                self.backward(loss)
        else:
            loss = loss_fn(torch.func.functional_call(model, copies, (x,)), y)
            self.backward(loss)
        for n, p in sharded.items():
            g = copies[n].grad
            if g is None:
                continue
            for shard in p.local_shards():
                part = g[_shard_slices(shard.metadata)].clone()
                t = shard.tensor
                t.grad = part if t.grad is None else t.grad.add_(part)
        return loss.detach()

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """ShardedTensor.gather to rank 0, checked against the shards every
        rank holds (assembled by their metadata), then broadcast: every rank
        needs the copy."""
        if not _is_sharded(t):
            return t
        out = torch.empty(t.size(), dtype=t.dtype, device=self._device(t)) if dist.get_rank(self.group) == 0 else None
        t.gather(dst=0, out=out)
        if out is None:
            out = torch.empty(t.size(), dtype=t.dtype, device=self._device(t))
        dist.broadcast(out, src=dist.get_global_rank(self.group, 0), group=self.group)
        shards = self._assemble(t, {tuple(s.metadata.shard_offsets): s.tensor.detach().cpu() for s in t.local_shards()}, t)
        if shards is not None and not torch.allclose(out, shards, rtol=0.0, atol=0.0, equal_nan=True):
            raise GatherMismatch(f"ShardedTensor.gather(dst=0, out=<{t.dtype} tensor>) returns other values than the "
                                 f"shards hold (max abs diff {(out - shards).abs().max().item():.3g})")
        return out

    def _device(self, st) -> torch.device:
        return torch.device(st.metadata().shards_metadata[0].placement.device())

    def _assemble(self, st, per_shard: dict, like) -> torch.Tensor | None:
        """A full tensor from every rank's {shard offsets: tensor} (None where no rank has one)."""
        parts = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, per_shard, group=self.group)
        return self._place(st, [(offsets, v) for part in parts for offsets, v in part.items()], like.dtype)

    def _place(self, st, pieces: list, dtype) -> torch.Tensor | None:
        """A full tensor of ``st``'s shape with each (offsets, shard tensor) in place."""
        if not pieces:
            return None
        out = torch.zeros(st.size(), dtype=dtype, device=self._device(st))
        for offsets, v in pieces:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, v.shape))] = v.to(out.device)
        return out

    def full_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if not _is_sharded(p):
            return super().full_grad(p)
        mine = {tuple(s.metadata.shard_offsets): s.tensor.grad.detach().cpu()
                for s in p.local_shards() if s.tensor.grad is not None}
        return self._assemble(p, mine, p)

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        """Dense params' state as it is; a sharded param's state assembled from
        its shards' (tensors shaped like the shard are placed at its offsets,
        scalars such as ``step`` are taken from the shards, which must agree).
        Every rank's shard states travel in one all_gather_object."""
        params = {plain_fqn(n): p for n, p in model.named_parameters()}  # plain FQNs (a CheckpointWrapper)
        mine = {n: [(tuple(s.metadata.shard_offsets), list(s.metadata.shard_sizes),
                     {k: as_tensor(v).detach().cpu() for k, v in (opt.state.get(s.tensor) or {}).items()})
                    for s in p.local_shards()]
                for n, p in params.items() if _is_sharded(p)}
        parts = [None] * dist.get_world_size(self.group)
        if mine:  # every rank shards the same params
            dist.all_gather_object(parts, mine, group=self.group)
        out = {}
        for n, p in params.items():
            if not _is_sharded(p):
                if opt.state.get(p):
                    out[n] = {k: as_tensor(v).detach().clone() for k, v in sorted(opt.state[p].items())}
                continue
            shards = [shard for part in parts for shard in part[n]]
            full = {}
            for key in sorted({k for _, _, st in shards for k in st}):
                values = [(offsets, sizes, st[key]) for offsets, sizes, st in shards if key in st]
                scalars = [v for _, sizes, v in values if list(v.shape) != sizes]
                if scalars:
                    full[key] = scalars[0].to(self._device(p))
                    if any(not torch.equal(v, scalars[0]) for v in scalars):
                        full[key] = torch.full_like(full[key], float("nan"))  # shards disagree: never equals the reference
                else:
                    full[key] = self._place(p, [(offsets, v) for offsets, _, v in values], p.dtype)
            if full:
                out[n] = full
        return out

