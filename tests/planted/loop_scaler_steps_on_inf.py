"""Planted bug (issue 38, gradient scaling): ``GradScaler._maybe_opt_step``
steps an optimizer over DTensor params even when ``unscale_`` found an inf or
a NaN in its grads: an overflowing step, which every rank must skip, is
applied (the params go non-finite); the scale still backs off. Optimizers over
plain tensors (the reference) skip as they should."""
import torch.amp.grad_scaler as grad_scaler
from torch.distributed.tensor import DTensor

orig = grad_scaler.GradScaler._maybe_opt_step
if not getattr(orig, "_planted", False):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
            return optimizer.step(*args, **kwargs)  # found_inf_per_device never read
        return orig(self, optimizer, optimizer_state, *args, **kwargs)

    _maybe_opt_step._planted = True
    grad_scaler.GradScaler._maybe_opt_step = _maybe_opt_step
