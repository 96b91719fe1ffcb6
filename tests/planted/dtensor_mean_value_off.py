"""Planted bug: the mean of a sharded DTensor has a wrong value and a right
grad, as torch 2.9.1's mean over an unevenly sharded dim does (a Partial(avg)
of the local means: 2.1245 for 2.1954). The loss differs, no module's output
or output grad does: under a grad scaler the localizer must name no module
(the sharded run's output grads are of the scaled loss)."""
import torch
from torch.distributed.tensor import DTensor, Shard

_mean = torch.Tensor.mean


def mean(self, *args, **kwargs):
    out = _mean(self, *args, **kwargs)
    if isinstance(self, DTensor) and any(isinstance(p, Shard) for p in self.placements):
        out = out + out.detach() * 0.03  # the value off by 3%, the grad untouched
    return out


torch.Tensor.mean = mean
