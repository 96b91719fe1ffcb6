"""Planted bug: a param replicated on every mesh dim (all Replicate) whose grad
is replicated too is stepped twice on every rank but the mesh's first (a
plain SGD step of its grad again, after the optimizer's), as a replicated op
run once more on one side would. The reporting rank's copy is right: only the
replica oracle sees it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402


def _replicated(t) -> bool:
    return isinstance(t, DTensor) and all(isinstance(pl, Replicate) for pl in t.placements)


def make_step(orig):
    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for g in self.param_groups:
                lr = float(g["lr"])
                for p in g["params"]:
                    if _replicated(p) and _replicated(p.grad) and any(p.device_mesh.get_coordinate()):
                        p.to_local().sub_(lr * p.grad.to_local())
        return out

    return step


wrap_steps(make_step)
