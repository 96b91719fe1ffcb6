"""Planted bug: PowerSGDState.__setstate__ turns warm start off: the loaded P and Q equal the saved ones (the
loaded check passes), but the resumed run draws a fresh Q where the uninterrupted one reuses its own."""
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

_setstate = powerSGD_hook.PowerSGDState.__setstate__


def __setstate__(self, state):
    _setstate(self, state)
    self.warm_start = False


powerSGD_hook.PowerSGDState.__setstate__ = __setstate__
