"""Planted bug: the functional all_to_all_single_autograd (what expert parallelism's token dispatch and combine
send the routed tokens with, uneven splits) reads each destination's chunk one row late: the split sizes stay
right, the offsets are off by one token (the input rolled by one row), so the token at each boundary lands on
the neighbouring rank's experts and comes back to the wrong slot. Nothing raises; every shape is right. An EP
degree of 1 (no all-to-all of more than one rank) hides it."""
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

_orig = funcol.all_to_all_single_autograd


def all_to_all_single_autograd(self, output_split_sizes, input_split_sizes, group, tag=""):
    size = dist.get_world_size(group) if isinstance(group, dist.ProcessGroup) else 2
    if input_split_sizes is not None and size > 1 and self.shape[0] > 1:
        self = torch.roll(self, -1, 0)
    return _orig(self, output_split_sizes, input_split_sizes, group, tag)


funcol.all_to_all_single_autograd = all_to_all_single_autograd
