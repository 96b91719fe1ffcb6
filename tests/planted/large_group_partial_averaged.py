"""Planted bug that shows only at world size 5 or more: reducing a
Partial("sum") DTensor over a mesh dim of 5 or more ranks divides the sum by
the group size (a "large group" path that took DP's averaging habit), so a
matmul whose contracted dim is sharded over 5+ ranks gives 1/n of its value.
Every rank computes the same wrong value: nothing raises. At 1-4 ranks per
mesh dim the reduction is the real one."""
from torch.distributed.tensor import Partial

_orig = Partial._reduce_value


def _reduce_value(self, tensor, mesh, mesh_dim):
    out = _orig(self, tensor, mesh, mesh_dim)
    n = mesh.size(mesh_dim)
    return out / n if n >= 5 and self.reduce_op == "sum" else out


Partial._reduce_value = _reduce_value
