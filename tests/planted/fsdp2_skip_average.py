"""Planted bug: FSDP2's reduce-scatter skips the averaging for one unevenly
sharded param (its sharded grad stays a sum over the ranks)."""
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

_orig = group_mod.foreach_reduce


def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs):
    out = _orig(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs)
    world = reduce_scatter_group.size()
    for fp in fsdp_params:
        p = fp.sharded_param
        if world > 1 and p.shape[0] % world and p.grad is not None:
            with torch.no_grad():
                p.grad._local_tensor.mul_(world)  # undo the 1/world average
            break  # one param only
    return out


group_mod.foreach_reduce = foreach_reduce
