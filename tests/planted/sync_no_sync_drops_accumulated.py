"""Planted bug: FSDP2's gradient accumulation without sync drops what the last rank accumulated: when
set_requires_gradient_sync(True) turns the sync back on (before the last microbatch), that rank throws
away the unsharded grads of the microbatches before, so it reduce-scatters only the last one's. Every
rank still runs the same collectives: silent, no hang."""
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

_orig = FSDPModule.set_requires_gradient_sync


def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
    if requires_gradient_sync and dist.get_rank() == dist.get_world_size() - 1:
        for module in (self.modules() if recurse else [self]):
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    if group.reduce_grads:
                        continue  # it synced already: nothing accumulated
                    for fp in group.fsdp_params:
                        fp.unsharded_accumulated_grad = None
                        if hasattr(fp, "_unsharded_param"):
                            fp._unsharded_param.grad = None
    return _orig(self, requires_gradient_sync, recurse=recurse)


FSDPModule.set_requires_gradient_sync = set_requires_gradient_sync
