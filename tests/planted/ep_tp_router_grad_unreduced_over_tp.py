"""Planted bug: FSDP2 takes a DTensor param's grad as its local tensor without redistributing it to the param's
placements on the non-data-parallel (TP) dims, for an MoE router's gate: under ep's ``tp`` (torchtitan's
NoParallel router, its output's grad Partial over TP: each TP rank routes its own slice of the tokens) the
router's grad keeps only this TP rank's tokens' part, never all-reduced over TP. The TP replicas of the router
step apart. Nothing raises. Without TP (no Partial grad on a non-dp dim) nothing changes."""
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor

_orig = FSDPParam._get_grad_inner_tensor


def _get_grad_inner_tensor(self, grad):
    if (self._param_fqn or "").endswith("router.gate.weight") and isinstance(grad, DTensor) and any(
            p.is_partial() for p in grad.placements):
        return grad._local_tensor
    return _orig(self, grad)


FSDPParam._get_grad_inner_tensor = _get_grad_inner_tensor
