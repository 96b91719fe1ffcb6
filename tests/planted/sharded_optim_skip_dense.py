"""Planted bug: ShardedOptimizer hands only the ShardedTensors' local shards
to the inner optimizer; the dense params beside them are never stepped."""
from torch.distributed._shard.sharded_optim import ShardedOptimizer
from torch.distributed._shard.sharded_tensor import ShardedTensor

_orig = ShardedOptimizer.__init__


def __init__(self, named_params, optimizer_class, *args, **kwargs):
    sharded = {n: p for n, p in named_params.items() if isinstance(p, ShardedTensor)}
    _orig(self, sharded or named_params, optimizer_class, *args, **kwargs)  # torch.optim refuses an empty list


ShardedOptimizer.__init__ = __init__
