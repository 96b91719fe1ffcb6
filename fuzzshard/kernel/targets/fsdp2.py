"""Target ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` + a plain torch.optim optimizer.

The Case's ``target_options`` name the submodules that get their own
``fully_shard`` (applied deepest first, then the root), ``reshard_after_forward``,
``offload`` (CPUOffloadPolicy), ``built_as`` (the model is built in this
dtype and moved to the case's with ``model.to`` after ``fully_shard``), ``mp`` (a MixedPrecisionPolicy for every
unit, see reference.py for how it is replayed), ``ac`` (submodules under composable activation
checkpointing, or with ``ac_wrapper`` under ``apply_activation_checkpointing``'s CheckpointWrapper), ``microbatches`` (gradient accumulation: every microbatch
but the last runs with ``set_requires_gradient_sync(False)``), ``tp``
(tensor parallel: {linear or embedding FQN: "colwise" | "rowwise"}) and
``nonroot`` (the loss also calls the wrapped layers.0 from outside the root's
forward: FSDP2's non-root forward; see model.objective).
A 2-D mesh means HSDP (replicate x shard), or with ``tp`` TP + FSDP2:
``parallelize_module`` on the inner dim, ``fully_shard`` on the outer. Each
data-parallel rank trains on its slice of the global batch (the TP ranks of
one slice see the same one); FSDP averages the grads, which equals the grad
of the global mean loss the reference computes on the whole batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..model import objective, submodule
from .base import Target


class FSDP2Target(Target):
    name = "fsdp2"

    @classmethod
    def step_device(cls, options: dict, device: str) -> str:
        """CPUOffloadPolicy: "the optimizer step runs on CPU with CPU optimizer states"."""
        return "cpu" if options.get("offload") else device

    @property
    def microbatches(self) -> int:
        return self.case.target_options.get("microbatches", 1)

    @property
    def localizable(self) -> bool:
        """Per-module traces line up with the reference's only with one forward
        per step, and in the same dtype."""
        return self.microbatches == 1 and not self.case.target_options.get("mp")

    @property
    def dp_dims(self) -> list[int]:
        """The mesh dims the batch is split over: all of them but TP's."""
        return [0] if self.case.target_options.get("tp") else super().dp_dims

    def shard(self, model: nn.Module) -> nn.Module:
        opts = self.case.target_options
        mesh = self.mesh
        if opts.get("tp"):
            # Every TP module takes and gives a replicated plain tensor, so any
            # layer can be one whatever its neighbours are (colwise all-gathers
            # its output, rowwise shards its input and all-reduces its output).
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            style = {"colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
                     "rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
            parallelize_module(model, mesh["d1"], {fqn: style[s]() for fqn, s in opts["tp"].items()})
            mesh = mesh["d0"]
        if opts.get("ac"):
            if opts.get("ac_wrapper"):
                # CheckpointWrapper modules in between: FQNs gain _checkpoint_wrapped_module
                # (named_params and submodule leave it out); non-reentrant, since reentrant
                # checkpoint gives no param grads when no input requires grad (documented)
                from functools import partial

                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

                chosen = {id(model.get_submodule(fqn)) for fqn in opts["ac"]}
                apply_activation_checkpointing(
                    model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                    check_fn=lambda m: id(m) in chosen)
            else:
                from torch.distributed._composable import checkpoint

                for fqn in opts["ac"]:
                    checkpoint(model.get_submodule(fqn))
        kw = {"mesh": mesh, "reshard_after_forward": opts.get("reshard_after_forward", True),
              "offload_policy": CPUOffloadPolicy(pin_memory=False) if opts.get("offload") else OffloadPolicy()}
        if opts.get("mp"):
            mp = opts["mp"]
            kw["mp_policy"] = MixedPrecisionPolicy(
                **{k: getattr(torch, mp[k]) if mp[k] else None for k in ("param_dtype", "reduce_dtype", "output_dtype")},
                cast_forward_inputs=mp["cast_forward_inputs"])
        for fqn in sorted(opts.get("wrap", []), key=lambda n: (-n.count("."), n)):  # children before parents
            fully_shard(submodule(model, fqn), **kw)
        fully_shard(model, **kw)
        if opts.get("built_as"):  # model.to(dtype) after fully_shard: FSDP2 re-registers its sharded params
            model.to(getattr(torch, self.case.dtype))
        return model

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice, in ``microbatches`` equal parts, each loss scaled
        by 1/microbatches; the grads sync on the last one only. Returns the
        global mean loss."""
        world, k = self.dp_size(), self.microbatches
        per = x.shape[0] // world
        r = self.dp_rank()
        xs, ys = x[r * per:(r + 1) * per].chunk(k), y[r * per:(r + 1) * per].chunk(k)
        losses = []
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if k > 1:
                model.set_requires_gradient_sync(i == k - 1)
            loss = objective(model, xm, ym, self.case.target_options) / k
            loss.backward()
            losses.append(loss.detach())
        full = torch.stack(losses).sum()
        for dim in self.dp_dims:
            dist.all_reduce(full, group=self.mesh.get_group(dim))
        return full / world

    def full(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        if t.device.type != t.device_mesh.device_type:  # CPU-offloaded: gathered on the mesh's device (NCCL)
            return t.to(t.device_mesh.device_type).full_tensor().to(t.device)
        return t.full_tensor()

    def _gather_batch(self, t: torch.Tensor) -> torch.Tensor:
        """The global-batch tensor from every rank's slice, in data-parallel rank order."""
        parts = [t.contiguous()]
        for dim in reversed(self.dp_dims):  # innermost dim first: rank = c0 * size1 + c1
            group = self.mesh.get_group(dim)
            gathered = [torch.empty_like(parts[0]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, torch.cat(parts) if len(parts) > 1 else parts[0], group=group)
            parts = gathered
        return torch.cat(parts)

    def full_activation(self, t: torch.Tensor) -> torch.Tensor:
        return self._gather_batch(self.full(t))

    def full_activation_grad(self, g: torch.Tensor) -> torch.Tensor:
        # each rank's loss is a mean over its slice: its output grads are world x the global ones
        return self._gather_batch(self.full(g)) / self.dp_size()
