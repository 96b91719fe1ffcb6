"""Planted bug (in the training code around torch, as a user writes it): the pipeline's tied weight's grad
is reduced to the first stage's rank only (dist.reduce where Megatron-LM's embedding group all-reduces), so
the last stage's rank steps its copy of the tied weight (the head's) with its own use's part of the grad.
The grad the first stage holds is right; the two copies differ after the first step: the replica oracle
(every copy of the tied weight is one value), before any parity mismatch."""
import torch.distributed as dist

from fuzzshard.kernel.targets import pp

_orig = pp.PPTarget.reduce_tied_grad


def reduce_tied_grad(self, model):
    real = dist.all_reduce

    def to_first(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return dist.reduce(t, dst=dist.get_global_rank(group, 0), op=op, group=group)

    dist.all_reduce = to_first
    try:
        _orig(self, model)
    finally:
        dist.all_reduce = real


pp.PPTarget.reduce_tied_grad = reduce_tied_grad
