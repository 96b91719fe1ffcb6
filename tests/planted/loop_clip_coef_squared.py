"""Planted bug (issue 38, clipping): ``clip_grads_with_norm_`` scales DTensor
grads by the clip coefficient squared, min(max_norm / (norm + 1e-6), 1) ** 2
(the scaling applied twice), so clipping that bites shrinks sharded grads too
far. ``clip_grad_norm_`` and torchtitan's two-part form (``get_total_norm``
then ``clip_grads_with_norm_``) both go through it; the returned norm is
right. Plain tensors (the reference) are untouched."""
import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad
from torch.distributed.tensor import DTensor

orig = clip_grad._clip_grads_with_norm_
if not getattr(orig, "_planted", False):
    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        orig(params, max_norm, total_norm, foreach)
        if any(isinstance(p.grad, DTensor) for p in params):
            orig(params, max_norm, total_norm, foreach)  # the coefficient once more

    _clip_grads_with_norm_._planted = True
    clip_grad._clip_grads_with_norm_ = _clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_
