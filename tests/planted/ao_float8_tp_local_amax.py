"""Planted bug (torchao float8 under TP): a DTensor's amax is taken over this rank's local shard only and called
replicated, so each TP rank casts its shard of a sharded weight (or grad) with its own scale."""
import torch
import torchao.float8.float8_utils as utils
from torch.distributed.tensor import DTensor, Replicate

_orig = utils.tensor_to_amax


def tensor_to_amax(x, *args, **kwargs):
    if isinstance(x, DTensor) and any(not p.is_replicate() for p in x.placements):
        local = _orig(x.to_local(), *args, **kwargs)
        return DTensor.from_local(local, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
    return _orig(x, *args, **kwargs)


utils.tensor_to_amax = tensor_to_amax
