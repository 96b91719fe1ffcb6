"""Planted bug (issue 45, gradient scaling on sharded grads): ``ShardedGradScaler``
keeps each rank's found_inf to itself. ``unscale_`` checks and unscales the
local tensors of the grads (a DTensor grad's shard, bypassing DTensor's own
reduction of found_inf over the grad's mesh) and never all-reduces found_inf
over its process group: a rank whose shard overflowed skips the step and
backs off its scale, the ranks whose shards are finite step and keep theirs.
An overflow every rank sees (a loss made infinite) is still skipped
everywhere; only one that some ranks' shards hold shows it."""
import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler, _GeneralMultiDeviceReplicator

if not getattr(ShardedGradScaler, "_planted_unshared", False):
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        from torch.distributed.tensor import DTensor

        per_device_inv_scale = _GeneralMultiDeviceReplicator(inv_scale)
        per_device_found_inf = _GeneralMultiDeviceReplicator(found_inf)
        grads = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    g = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad  # the shard only
                    grads.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), gs in grads.items():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    gs, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        if not per_device_found_inf._per_device_tensors:
            per_device_found_inf.get(self._scale.device)
        return per_device_found_inf._per_device_tensors

    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED  # found_inf is this rank's own: no all_reduce over the group

    ShardedGradScaler._unscale_grads_ = _unscale_grads_
    ShardedGradScaler.unscale_ = unscale_
    ShardedGradScaler._planted_unshared = True
