"""Planted bug: ZeroRedundancyOptimizer.state_dict(), after
consolidate_state_dict, keeps only the state of the params rank 0 owns."""
from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

_orig = Zero.state_dict


def state_dict(self):
    sd = _orig(self)
    index = self._param_to_index
    others = {index[p] for p, rank in self._param_to_rank.items() if rank > 0}
    sd["state"] = {i: st for i, st in sd["state"].items() if i not in others}
    return sd


Zero.state_dict = state_dict
