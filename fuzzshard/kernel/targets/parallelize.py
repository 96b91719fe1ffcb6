"""A user's parallelism as a target: ``parallelize(model, mesh, options)``
(torchtitan style: TP on one mesh dim, FSDP2 on the other), registered with
``fuzzshard.plugin.parallelism`` and run against the unsharded model.

The function gets the plain model, the case's DeviceMesh (1-D, or 2-D with
dims "d0" and "d1") and the options its strategy drew, and returns
the model to train (or shards it in place). Its params must come out as
plain tensors or DTensors; everything after the sharding is FSDP2's target's:
each rank trains on its slice of the global batch over the data-parallel
mesh dims (all of them, or "d0" alone when the options hold a truthy "tp"),
and params, grads and state are gathered with ``full_tensor()``.
"""
from __future__ import annotations

import torch.nn as nn

from .fsdp2 import FSDP2Target

# name -> (parallelize, dp_dims or None): what the plugin registered (the
# repro script's --setup registers it again in the script's own kernel)
USER_PARALLELISMS: dict = {}


class ParallelizeTarget(FSDP2Target):
    name = "parallelize"
    script_class = "ParallelizeTarget"  # what a repro script names (each plugin's target is a subclass)
    known_as = ("fsdp2", "dtensor")  # their known torch bugs are this target's too (findings.is_known)

    @property
    def _registered(self) -> tuple:
        if self.case.target not in USER_PARALLELISMS:
            raise ValueError(f"target {self.case.target!r} is a plugin's parallelism: pass its file (--plugin / --setup)")
        return USER_PARALLELISMS[self.case.target]

    @property
    def dp_dims(self) -> list[int]:
        dims = self._registered[1]
        return list(dims(self.mesh.ndim, self.case.target_options)) if dims else super().dp_dims

    @property
    def localizable(self) -> bool:
        return False  # its activations may be sharded any way it likes: the oracles compare params, grads, state

    def shard(self, model: nn.Module) -> nn.Module:
        out = self._registered[0](model, self.mesh, self.case.target_options)
        return model if out is None else out
