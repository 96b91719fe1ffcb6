"""Planted contamination (a fuzzshard-side fault, not a torch bug): state that
one case leaves in a worker process changes the next. From its fourth case
on, a worker's SGD skips weight decay on DTensor params (the reference's
plain params are left alone), so a warm worker reports a parity
divergence that fresh workers, which have run nothing before, do not show.
A session must call that contaminated, never a finding."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from _wrap import wrap_steps  # noqa: E402

from fuzzshard.case import Case  # noqa: E402

CASES_BEFORE_THE_LEAK = 3
_seen = {"cases": 0}
_from_json = Case.from_json.__func__


def _counting_from_json(cls, text):
    _seen["cases"] += 1  # the worker reads each case it runs from JSON once
    return _from_json(cls, text)


Case.from_json = classmethod(_counting_from_json)


def make_step(orig):
    def step(self, *args, **kwargs):
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        if not (isinstance(self, torch.optim.SGD) and sharded and _seen["cases"] > CASES_BEFORE_THE_LEAK):
            return orig(self, *args, **kwargs)
        saved = [g["weight_decay"] for g in self.param_groups]
        for g in self.param_groups:
            g["weight_decay"] = 0.0
        try:
            return orig(self, *args, **kwargs)
        finally:
            for g, wd in zip(self.param_groups, saved):
                g["weight_decay"] = wd

    return step


wrap_steps(make_step)
