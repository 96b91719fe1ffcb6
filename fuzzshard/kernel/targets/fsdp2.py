"""Target ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` + a plain torch.optim optimizer.

The Case's ``target_options`` name the submodules that get their own
``fully_shard`` (applied deepest first, then the root) and
``reshard_after_forward``. A 2-D mesh means HSDP (replicate x shard). Each rank
trains on its slice of the global batch; FSDP averages the grads, which equals
the grad of the global mean loss the reference computes on the whole batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ...case import Case
from ..model import loss_fn


class FSDP2Target:
    name = "fsdp2"

    def __init__(self, case: Case, mesh):
        self.case = case
        self.mesh = mesh

    def shard(self, model: nn.Module) -> nn.Module:
        opts = self.case.target_options
        raf = opts.get("reshard_after_forward", True)
        for fqn in sorted(opts.get("wrap", []), key=lambda n: (-n.count("."), n)):  # children before parents
            fully_shard(model.get_submodule(fqn), mesh=self.mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=raf)
        return model

    def _dp_rank(self) -> int:
        """This rank's index among all data-parallel ranks (every mesh dim is data parallel)."""
        rank = 0
        for dim, c in enumerate(self.mesh.get_coordinate()):
            rank = rank * self.mesh.size(dim) + c
        return rank

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        world = self.mesh.size()
        per = x.shape[0] // world
        r = self._dp_rank()
        loss = loss_fn(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
        full = loss.detach().clone()
        for dim in range(self.mesh.ndim):
            dist.all_reduce(full, group=self.mesh.get_group(dim))
        return loss, full / world

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def _gather_batch(self, t: torch.Tensor) -> torch.Tensor:
        """The global-batch tensor from every rank's slice, in data-parallel rank order."""
        parts = [t.contiguous()]
        for dim in reversed(range(self.mesh.ndim)):  # innermost dim first: rank = c0 * size1 + c1
            group = self.mesh.get_group(dim)
            gathered = [torch.empty_like(parts[0]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, torch.cat(parts) if len(parts) > 1 else parts[0], group=group)
            parts = gathered
        return torch.cat(parts)

    def full_activation(self, t: torch.Tensor) -> torch.Tensor:
        return self._gather_batch(self.full(t))

    def full_activation_grad(self, g: torch.Tensor) -> torch.Tensor:
        # each rank's loss is a mean over its slice: its output grads are world x the global ones
        return self._gather_batch(self.full(g)) / self.mesh.size()
