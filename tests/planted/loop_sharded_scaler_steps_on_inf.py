"""Planted bug (issue 38, gradient scaling on FSDP): ``ShardedGradScaler``
steps the optimizer even when ``unscale_`` found an inf or a NaN in some
rank's shard of the grads (found_inf, all-reduced over its group, never
read): an overflowing step, which every rank must skip, is applied (the
params go non-finite); the scale still backs off. torch.amp.GradScaler (the
reference's) skips as it should."""
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

if not getattr(ShardedGradScaler, "_planted", False):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)  # found_inf_per_device never read

    ShardedGradScaler._maybe_opt_step = _maybe_opt_step
    ShardedGradScaler._planted = True
