"""Planted bug: PowerSGDState.__setstate__ drops the error dict (error feedback's per-bucket local error): a
resumed run starts its error feedback from zeros, unlike the uninterrupted one."""
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

_setstate = powerSGD_hook.PowerSGDState.__setstate__


def __setstate__(self, state):
    _setstate(self, state)
    self.error_dict = {}


powerSGD_hook.PowerSGDState.__setstate__ = __setstate__
