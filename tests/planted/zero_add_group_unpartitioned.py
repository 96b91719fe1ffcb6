"""Planted bug: ZeroRedundancyOptimizer.add_param_group after the constructor
records the group but never repartitions, so no rank's local optimizer holds
the new params and nobody steps them."""
from torch.distributed.optim import ZeroRedundancyOptimizer as Zero
from torch.optim import Optimizer

_orig = Zero.add_param_group


def add_param_group(self, param_group):
    if not self.initialized:
        return _orig(self, param_group)
    Optimizer.add_param_group(self, param_group)


Zero.add_param_group = add_param_group
