"""Planted bug in a collective below the modules, that needs 6 or more ranks
on one mesh dim and an uneven shard: gathering a Shard(d) DTensor whose dim d
does not split evenly over a mesh dim of 6 or more ranks (Shard's
_to_replicate_tensor: all-gather the padded shards, then cut the padding
off) loses the last row of that dim: it comes back as zeros. Nothing raises.
It shows wherever such a tensor is gathered: a Linear's sharded output, an
Embedding's or a LayerNorm's sharded weight, an optimizer's view of a param;
so a simulated session meets it under several modules' signatures, and with
every shard even (widths a multiple of the ranks) never: one bug, begun at 6
ranks when the shards are uneven at 5 and at 6 alike."""
import torch
from torch.distributed.tensor import Shard

_orig = Shard._to_replicate_tensor


def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
    out = _orig(self, local_tensor, mesh, mesh_dim, current_logical_shape)
    n, size = mesh.size(mesh_dim=mesh_dim), current_logical_shape[self.dim]
    if n < 6 or size % n == 0 or size < 1:
        return out
    kept = out.narrow(self.dim, 0, size - 1)
    return torch.cat([kept, torch.zeros_like(out.narrow(self.dim, size - 1, 1))], dim=self.dim)


Shard._to_replicate_tensor = _to_replicate_tensor
