"""Planted hang: on 2+ ranks, rank 1 blocks forever in Adagrad's step (any
Adagrad case, so the search finds it and shrinking can walk through it)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _wrap import wrap_steps  # noqa: E402


def make_step(orig):
    def step(self, *args, **kwargs):
        if isinstance(self, torch.optim.Adagrad) and dist.is_initialized() and dist.get_rank() == 1:
            while True:
                time.sleep(1)
        return orig(self, *args, **kwargs)

    return step


wrap_steps(make_step)
