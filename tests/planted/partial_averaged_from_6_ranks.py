"""Planted bug that needs 6 or more ranks on one mesh dim: reducing a
Partial("sum") DTensor over a mesh dim of 6 or more ranks divides the sum by
the group size (large_group_partial_averaged.py's bug, one rank later). Every
rank computes the same wrong value: nothing raises. It shows wherever a sum
is reduced over such a dim: a Linear contracting a sharded dim, a row-wise
Embedding's masked lookup, a LayerNorm over a sharded dim. So a simulated
session meets it at many world sizes, on 2-D meshes too (a dim of 6+ ranks),
under several modules' signatures: one bug, whose least case is 6 ranks on
a 1-D mesh."""
from torch.distributed.tensor import Partial

_orig = Partial._reduce_value


def _reduce_value(self, tensor, mesh, mesh_dim):
    out = _orig(self, tensor, mesh, mesh_dim)
    n = mesh.size(mesh_dim)
    return out / n if n >= 6 and self.reduce_op == "sum" else out


Partial._reduce_value = _reduce_value
