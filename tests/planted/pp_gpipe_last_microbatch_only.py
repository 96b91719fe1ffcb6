"""Planted bug: in ScheduleGPipe, each microbatch's backward (backward_one_chunk
after the first) replaces the param grads the earlier microbatches left
instead of adding to them, the shape of pytorch#139404 (a stage kept only
its latest backward result): each stage's params end up with the grads of
the last microbatch alone (scaled by n_microbatches with scale_grads). The
input grads sent on are right. Nothing raises; a single microbatch, and
1F1B and the multi-stage schedules, hide it."""
from torch.distributed.pipelining import schedules, stage

_orig_step = schedules.ScheduleGPipe._step_microbatches
_orig_backward = stage._PipelineStageBase.backward_one_chunk


def _step_microbatches(self, *args, **kwargs):
    self._stage._planted_gpipe = True
    return _orig_step(self, *args, **kwargs)


def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
    if getattr(self, "_planted_gpipe", False) and bwd_chunk_id > 0:
        for p in self.submod.parameters():  # the earlier microbatches' grads dropped: this one's replace them
            p.grad = None
    return _orig_backward(self, bwd_chunk_id, *args, **kwargs)


schedules.ScheduleGPipe._step_microbatches = _step_microbatches
stage._PipelineStageBase.backward_one_chunk = backward_one_chunk
