"""Planted bug: under HSDP a custom gradient divide factor (set_gradient_divide_factor) is applied on top of
the replicate dim's own averaging: after the all-reduce the grads are divided by the replicate size too, so
they come out replicate-size times too small (2-D mesh with a factor set; 1-D meshes and the default
factor are untouched)."""
import torch.distributed.fsdp._fully_shard._fsdp_collectives as coll

_orig = coll._get_gradient_divide_factors


def _get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                                 force_sum_reduction_for_comms=False):
    pre, post, rs_op, ar_op = _orig(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor,
                                    force_sum_reduction_for_comms)
    if all_reduce_group is not None and factor is not None and all_reduce_group.size() > 1:
        post = (post or 1.0) * all_reduce_group.size()  # the replicate dim divided in again
    return pre, post, rs_op, ar_op


coll._get_gradient_divide_factors = _get_gradient_divide_factors
