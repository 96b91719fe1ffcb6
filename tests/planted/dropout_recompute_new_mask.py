"""Planted bug: activation checkpointing's recomputation draws a new dropout mask. torch.utils.checkpoint's
non-reentrant generator (what torch.utils.checkpoint.checkpoint, checkpoint_wrapper and the composable
checkpoint() all run) and the reentrant CheckpointFunction ignore ``preserve_rng_state``: the forward's generator state is not stashed, so the
recomputed forward draws its masks from the generator as it is at backward, not the forward's. The backward
then differentiates another mask than the forward applied: the grads of everything in and in front of the
checkpointed module are wrong (and the generator moves on, so the next microbatch's masks are others too)."""
import torch.utils.checkpoint as cp
from torch.distributed._composable import checkpoint_activation

_orig = cp._checkpoint_without_reentrant_generator


def _new_mask(fn, preserve_rng_state=True, *args, **kwargs):
    return _orig(fn, False, *args, **kwargs)


if not getattr(_orig, "_planted", False):
    _new_mask._planted = True
    cp._checkpoint_without_reentrant_generator = _new_mask
    checkpoint_activation._checkpoint_without_reentrant_generator = _new_mask

# the reentrant form (use_reentrant=True, CheckpointImpl.REENTRANT): CheckpointFunction stashes the state itself
_forward = cp.CheckpointFunction.forward
if not getattr(_forward, "_planted", False):
    def _reentrant_new_mask(ctx, run_function, preserve_rng_state, *args):
        return _forward(ctx, run_function, False, *args)

    _reentrant_new_mask._planted = True
    cp.CheckpointFunction.forward = staticmethod(_reentrant_new_mask)
