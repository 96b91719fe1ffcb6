"""Planted bug: DistributedDataParallel.no_sync() does nothing on rank 1, which
still all-reduces every microbatch's grads: its collectives no longer pair
with the other ranks' (each of those all-reduces once per step)."""
import contextlib

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

_no_sync = DDP.no_sync


@contextlib.contextmanager
def no_sync(self):
    if dist.get_rank(self.process_group) == 1:
        yield
        return
    with _no_sync(self):
        yield


DDP.no_sync = no_sync
