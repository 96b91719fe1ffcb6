"""Planted bug: a pipeline stage runs each microbatch's forward inside a fork of the generator, as the schedule
forks it around the stages' metadata inference (schedules.py _initialize_pp_stages): the fork stretched over
the real forward. The generator is given back after every microbatch, so each of a stage's microbatches draws
the first one's dropout masks instead of the next ones in the stream. Nothing raises; the masks differ from a
run of the whole model per microbatch from the rank's seed from the second microbatch on, and the loss and
every grad before the dropout with them. One microbatch in one schedule step (no accum), or a model without
dropout, hides it."""
import torch
from torch.distributed.pipelining import stage

_orig = stage._PipelineStageBase.forward_one_chunk


def forward_one_chunk(self, *args, **kwargs):
    with torch.random.fork_rng(devices=[]):  # (the CPU generator: the workers' device here)
        return _orig(self, *args, **kwargs)


if not getattr(_orig, "_planted", False):
    forward_one_chunk._planted = True
    stage._PipelineStageBase.forward_one_chunk = forward_one_chunk
