"""Planted bug: the optimizer step leaves the last rank's shard of an unevenly
sharded DTensor param untouched (its local values are restored after step)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402


def _uneven_last(p) -> bool:
    mesh = p.device_mesh
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard) and p.shape[pl.dim] % mesh.size(dim) and mesh.get_local_rank(dim) == mesh.size(dim) - 1:
            return True
    return False


def make_step(orig):
    def step(self, *args, **kwargs):
        keep = [(p, p.to_local().detach().clone()) for g in self.param_groups for p in g["params"]
                if isinstance(p, DTensor) and _uneven_last(p)]
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for p, local in keep:
                p.to_local().copy_(local)
        return out

    return step


wrap_steps(make_step)
