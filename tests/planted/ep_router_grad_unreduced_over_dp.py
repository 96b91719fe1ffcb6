"""Planted bug: FSDP2's gradient reduction of an MoE router's gate skips the all-reduce over the replicate
mesh dim (HSDP's outer dim: ep's 2-D [dp, ep] mesh replicates the router over "d0"): its grads are summed
over the EP ranks of one dp replica only, the other replicas' tokens left out, and the replicas step apart.
Nothing raises. A 1-D mesh (no replicate dim) hides it."""
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

_orig = _fsdp_param_group.foreach_reduce


def foreach_reduce(fsdp_params, *args, **kwargs):
    if any((p._param_fqn or "").endswith("router.gate.weight") for p in fsdp_params):
        args = list(args)
        args[8] = None  # all_reduce_group: the replicate dim's all-reduce skipped
    return _orig(fsdp_params, *args, **kwargs)


_fsdp_param_group.foreach_reduce = foreach_reduce
