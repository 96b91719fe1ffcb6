"""Planted bug: FSDP2's overflow-safe gradient reduction for a float16 reduce
dtype (divide before and after the sum instead of averaging) loses its
post-divide. Only mixed precision reduces in float16: at world size 4 (divide
by 2, sum, divide by 2) its grads come out twice too large; at 2 the
post-divide is 1 and nothing shows."""
import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

_orig = collectives._get_gradient_divide_factors


def _get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, *args, **kwargs):
    pre, post, rs_op, ar_op = _orig(reduce_scatter_group, all_reduce_group, reduce_dtype, *args, **kwargs)
    return (pre, None, rs_op, ar_op) if reduce_dtype == torch.float16 else (pre, post, rs_op, ar_op)


collectives._get_gradient_divide_factors = _get_gradient_divide_factors
