"""Planted bug (issue 38, LR scheduler state through a checkpoint): every
``torch.optim.lr_scheduler`` class's ``load_state_dict`` drops ``last_epoch``:
the loaded scheduler keeps the count it was built with (0), so it restarts its
schedule after a resume while ``_last_lr`` says otherwise (as #129079-like
loads did). Only a load meets it; the reference never loads its scheduler."""
import functools

import torch.optim.lr_scheduler as sched


def _dropping(orig):
    @functools.wraps(orig)
    def load_state_dict(self, state_dict):
        epoch = getattr(self, "last_epoch", None)
        orig(self, state_dict)
        if epoch is not None:
            self.last_epoch = epoch  # what it held before the load, not what was saved

    load_state_dict._planted = True
    return load_state_dict


for cls in [sched.LRScheduler, *(c for c in vars(sched).values()
                                  if isinstance(c, type) and issubclass(c, sched.LRScheduler))]:
    fn = cls.__dict__.get("load_state_dict")
    if fn is not None and not getattr(fn, "_planted", False):
        cls.load_state_dict = _dropping(fn)
