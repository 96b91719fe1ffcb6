"""Planted bug: in Schedule1F1B, the backward of the second microbatch (its
steady state's first backward when there are more microbatches than stages)
sends its input grads on, but its param grads are lost: each stage's
params end up with the grads of every microbatch but that one. Nothing
raises; a single microbatch, or GPipe and the multi-stage schedules, hide it."""
from torch.distributed.pipelining import schedules, stage

_orig_step = schedules.Schedule1F1B._step_microbatches
_orig_backward = stage._PipelineStageBase.backward_one_chunk


def _step_microbatches(self, *args, **kwargs):
    self._stage._planted_1f1b = True
    return _orig_step(self, *args, **kwargs)


def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
    if not getattr(self, "_planted_1f1b", False) or bwd_chunk_id != 1:
        return _orig_backward(self, bwd_chunk_id, *args, **kwargs)
    before = {p: None if p.grad is None else p.grad.clone() for p in self.submod.parameters()}
    out = _orig_backward(self, bwd_chunk_id, *args, **kwargs)
    for p, g in before.items():
        p.grad = g
    return out


schedules.Schedule1F1B._step_microbatches = _step_microbatches
stage._PipelineStageBase.backward_one_chunk = backward_one_chunk
