"""pp: not written straight-line yet. A pipeline's script needs what the
Writer's one-model-per-rank shape does not hold: each rank's stages cut from
the model (PipelineStage over its top-level layers), the schedule's step
with the inputs on the first stage's rank, params, grads and state gathered
from the rank that owns each, and a reference on the schedule's microbatches
(their summed or averaged losses, kernel/targets/pp.py's ``objective``),
not on the whole batch. ``unsupported`` says so for every case, and the
repro is the flattened kernel, which runs the target's module as the pool does."""
from __future__ import annotations

from ..case import Case

KINDS: dict = {}
FREEZE_BEFORE_SHARD = False

REASON = ("pipeline stages and schedules are not written straight-line yet (the flattened kernel runs "
          "kernel/targets/pp.py itself)")


def unsupported(case: Case, options: dict) -> str | None:
    return REASON
