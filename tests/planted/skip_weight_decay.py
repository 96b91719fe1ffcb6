"""Planted bug: the optimizer step skips weight decay for DTensor params in the
last param group only (when there are several). Plain tensors are untouched."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def make_step(orig):
    def step(self, *args, **kwargs):
        last = self.param_groups[-1]
        hit = len(self.param_groups) > 1 and last.get("weight_decay") and any(isinstance(p, DTensor) for p in last["params"])
        if not hit:
            return orig(self, *args, **kwargs)
        wd, last["weight_decay"] = last["weight_decay"], 0.0
        try:
            return orig(self, *args, **kwargs)
        finally:
            last["weight_decay"] = wd

    return step


wrap_steps(make_step)
