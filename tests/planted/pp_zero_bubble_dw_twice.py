"""Planted bug: in the zero-bubble split backward (a stage's weight backward,
backward_weight_one_chunk, run by ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV after the input backward), the
first microbatch's weight grads are accumulated twice: each stage's params
end up with dW of microbatch 0 counted twice. Nothing raises; the schedules
without a split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) hide it."""
import torch
from torch.distributed.pipelining import stage

_orig = stage._PipelineStageBase.backward_weight_one_chunk


def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
    if bwd_chunk_id != 0:
        return _orig(self, bwd_chunk_id, *args, **kwargs)
    before = {p: None if p.grad is None else p.grad.clone() for p in self.submod.parameters()}
    out = _orig(self, bwd_chunk_id, *args, **kwargs)
    with torch.no_grad():
        for p, g in before.items():
            if p.grad is not None:  # the dW this call added, added once more
                p.grad.add_(p.grad - (0 if g is None else g))
    return out


stage._PipelineStageBase.backward_weight_one_chunk = backward_weight_one_chunk
