"""Planted bug: FSDP1's no_sync() loses what the last rank accumulated: leaving the context, that rank
drops the unsharded grads its no_sync microbatches accumulated in each FlatParameter, so the next
(syncing) backward reduces only the last microbatch's grads there. The collectives stay the same on every
rank: silent, no hang."""
import contextlib

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

_orig = FSDP.no_sync


@contextlib.contextmanager
def no_sync(self):
    with _orig(self):
        yield
    if dist.get_rank() == dist.get_world_size() - 1:
        for handle in _get_fsdp_handles(self):
            fp = handle.flat_param
            if fp.grad is not None and fp.grad.shape == fp._unpadded_unsharded_size:
                fp.grad.zero_()  # the accumulated unsharded grad, gone


FSDP.no_sync = no_sync
