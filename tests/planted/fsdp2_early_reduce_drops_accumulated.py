"""Planted bug: FSDP2's post-backward hook that runs before autograd has accumulated a param's grad (the later
call's hook of a unit the forward calls twice) drops what the earlier microbatches accumulated instead of
reduce-scattering it. Units called once never take that path (their hook runs after the param's grad is in),
so only a twice-called unit under gradient accumulation shows it (kernel/targets/fsdp2.py split_reduced)."""
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

_orig = FSDPParamGroup.post_backward


def post_backward(self, *args):
    if self.reduce_grads:
        for fp in self.fsdp_params:
            if fp.unsharded_accumulated_grad is not None and getattr(fp, "_unsharded_param", None) is not None \
                    and fp._unsharded_param.grad is None:
                fp.unsharded_accumulated_grad = None
    return _orig(self, *args)


FSDPParamGroup.post_backward = post_backward
