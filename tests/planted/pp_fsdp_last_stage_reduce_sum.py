"""Planted bug: under pipeline parallelism with FSDP2 on the dp sub-mesh, the
last stage's reduce of its grads over dp (the schedule's perform_reduce_grad,
which runs FSDP2's post_backward) sums the dp ranks' grads instead of
averaging them: the loss stage's grads come out dp times too large. Nothing
raises; a 1-D mesh (no dp), FSDP2 without a pipeline and the other stages
hide it."""
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import stage

_orig_reduce = stage._PipelineStageBase.perform_reduce_grad


def perform_reduce_grad(self, grad_scale_factor):
    if self.is_last and isinstance(self.submod, FSDPModule):
        for state in fully_shard.state(self.submod)._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.gradient_divide_factor = 1.0  # a sum over dp, not the mean
                group.force_sum_reduction_for_comms = True  # (a plain SUM reduce-scatter, which gloo has)
    return _orig_reduce(self, grad_scale_factor)


stage._PipelineStageBase.perform_reduce_grad = perform_reduce_grad
