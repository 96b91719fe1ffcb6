"""Planted bug: ZeroRedundancyOptimizer.load_state_dict leaves every rank but
rank 0 with the param groups' hyperparameters it had before the load (as if
the loaded groups never reached them): after a load those ranks' lr is still
the fresh optimizer's. Rank 0, the reporting rank, is right: only the replica
oracle sees it, at the load."""
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

_orig = ZeroRedundancyOptimizer.load_state_dict


def load_state_dict(self, state_dict):
    before = [dict(g) for g in self.param_groups]
    _orig(self, state_dict)
    if dist.get_rank(self.process_group) != 0:
        for g, old, inner in zip(self.param_groups, before, self.optim.param_groups):
            g["lr"] = inner["lr"] = old["lr"]


ZeroRedundancyOptimizer.load_state_dict = load_state_dict
