"""Planted bug: ZeroRedundancyOptimizer's partition drops the last param of
the last param group: no rank owns it, so nobody ever steps it."""
from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

_orig = Zero._partition_parameters


def _partition_parameters(self, params_per_rank=None):
    partition = _orig(self, params_per_rank)
    last = self.param_groups[-1]["params"]
    if last:
        dropped = last[-1]
        for rank_groups in partition:  # in place: the cache every later call returns
            group = rank_groups[len(self.param_groups) - 1] if len(rank_groups) == len(self.param_groups) else None
            if group is not None and any(p is dropped for p in group["params"]):
                group["params"] = [p for p in group["params"] if p is not dropped]
    return partition


Zero._partition_parameters = _partition_parameters
