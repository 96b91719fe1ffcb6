"""Planted bug: under pipeline parallelism with FSDP2 on the dp sub-mesh and expert parallelism over the same dp
dim (pp's ``ep``), the stage's ``scale_grads`` (the schedule's divide of the summed microbatch grads by
n_microbatches) divides only the grads of the params FSDP2 manages, skipping the params the stage's fully_shard
ignores: EP's routed experts (Shard(0) over dp, outside FSDP). Their grads come out n_microbatches times too
large. Nothing raises; without ep (every param FSDP2's), without scale_grads or with one microbatch it hides."""
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import stage

_orig_scale = stage._PipelineStageBase.scale_grads


def scale_grads(self, grad_scale_factor):
    if grad_scale_factor == 1 or not isinstance(self.submod, FSDPModule):
        return _orig_scale(self, grad_scale_factor)
    managed = {id(p.sharded_param) for state in fully_shard.state(self.submod)._state_ctx.all_states
               for group in state._fsdp_param_groups for p in group.fsdp_params}
    for p in self.submod.parameters():
        if p.grad is not None and id(p) in managed:
            p.grad.div_(grad_scale_factor)


stage._PipelineStageBase.scale_grads = scale_grads
