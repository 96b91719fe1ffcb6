"""Planted bug (issue 45, gradient scaling on sharded grads): ``ShardedGradScaler.unscale_``
finds the infs and NaNs in this rank's shards of the grads but never all-reduces
found_inf over its process group: a rank whose shard overflowed skips the step
and backs off its scale, the ranks whose shards are finite step and keep theirs.
An overflow every rank sees (a loss made infinite) is still skipped everywhere;
only one that some ranks' shards hold shows it."""
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.amp.grad_scaler import OptState

if not getattr(ShardedGradScaler, "_planted_unshared", False):
    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        import torch

        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED  # found_inf is this rank's own: no all_reduce over the group

    ShardedGradScaler.unscale_ = unscale_
    ShardedGradScaler._planted_unshared = True
