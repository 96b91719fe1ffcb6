"""Planted bug: ZeRO's join hook steps a joined rank's partition without the
averaged grads (as if it dropped them): the params that rank owns stop
training while the others go on, and every rank gets them broadcast."""
import torch.distributed.optim.zero_redundancy_optimizer as zro

_orig = zro._ZeROJoinHook.main_hook


def main_hook(self):
    for group in self.zero.param_groups:
        for p in group["params"]:
            p.grad = None
    return _orig(self)


zro._ZeROJoinHook.main_hook = main_hook
