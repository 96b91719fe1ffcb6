"""Planted crash: on a 3-rank mesh, the last rank aborts inside Rprop's step
(any Rprop case at world size 3, nothing else): a corner that needs one world
size and one optimizer at once (bench --hunt)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def make_step(orig):
    def step(self, *args, **kwargs):
        if isinstance(self, torch.optim.Rprop):
            for g in self.param_groups:
                for p in g["params"]:
                    if isinstance(p, DTensor) and p.device_mesh.size() == 3 and p.device_mesh.get_rank() == \
                            p.device_mesh.mesh.flatten()[-1].item():
                        os.abort()
        return orig(self, *args, **kwargs)

    return step


wrap_steps(make_step)
