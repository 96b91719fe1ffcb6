"""Planted hang and crash, triggered by lr values the strategies never draw:
lr == 0.123 -> rank 1 sleeps forever inside step(); lr == 0.321 -> rank 1 aborts."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.distributed as dist  # noqa: E402
from _wrap import wrap_steps  # noqa: E402


def make_step(orig):
    def step(self, *args, **kwargs):
        lr = float(self.param_groups[0]["lr"])
        if dist.is_initialized() and dist.get_rank() == 1:
            if abs(lr - 0.123) < 1e-9:
                while True:
                    time.sleep(1)
            if abs(lr - 0.321) < 1e-9:
                os.abort()
        return orig(self, *args, **kwargs)

    return step


wrap_steps(make_step)
