"""Planted bug: a param replicated on every mesh dim (all Replicate) whose grad
is replicated too is stepped twice on every rank but the mesh's first (a
plain SGD step of its grad again, after the optimizer's), as a replicated op
run once more on one side would. The reporting rank's copy is right: only the
replica oracle sees it. The rank's branch runs per rank under --simulate too
(torch's maybe_run_for_local_tensor: each simulated rank its own coordinate
and its own copy), as LocalTensor cannot carry a Python branch on the rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

try:
    from torch.distributed._local_tensor import maybe_run_for_local_tensor
except ImportError:  # torch < 2.10: no LocalTensorMode, every rank its own process
    def maybe_run_for_local_tensor(f):
        return f


def _replicated(t) -> bool:
    return isinstance(t, DTensor) and all(isinstance(pl, Replicate) for pl in t.placements)


@maybe_run_for_local_tensor
def _step_again(param, grad, lr: float, coordinate) -> None:
    if any(coordinate):
        param.sub_(lr * grad)


def make_step(orig):
    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for g in self.param_groups:
                lr = float(g["lr"])
                for p in g["params"]:
                    if _replicated(p) and _replicated(p.grad):
                        _step_again(p.to_local(), p.grad.to_local(), lr, p.device_mesh.get_coordinate())
        return out

    return step


wrap_steps(make_step)
