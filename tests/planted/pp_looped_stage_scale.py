"""Planted bug: in the looped multi-stage schedules (ScheduleInterleaved1F1B,
ScheduleLoopedBFS), a rank's later virtual stages divide their summed
microbatch grads (scale_grads) by the rank's backward count over all its
stages (n_microbatches x stages per rank) instead of n_microbatches: their
grads come out too small by the stages-per-rank factor. Nothing raises; a
rank's first stage, scale_grads off, a single microbatch and the other
schedules hide it."""
from torch.distributed.pipelining import schedules, stage

_orig_reduce = stage._PipelineStageBase.perform_reduce_grad


def _flagging(cls):
    orig = cls._step_microbatches

    def _step_microbatches(self, *args, **kwargs):
        for i, s in enumerate(self._stages):
            s._planted_looped = (i, len(self._stages))
        return orig(self, *args, **kwargs)

    cls._step_microbatches = _step_microbatches


def perform_reduce_grad(self, grad_scale_factor):
    local, count = getattr(self, "_planted_looped", (0, 1))
    if local > 0 and grad_scale_factor != 1:
        grad_scale_factor *= count
    return _orig_reduce(self, grad_scale_factor)


_flagging(schedules.ScheduleInterleaved1F1B)
_flagging(schedules.ScheduleLoopedBFS)
stage._PipelineStageBase.perform_reduce_grad = perform_reduce_grad
