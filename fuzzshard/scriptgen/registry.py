"""Which module writes which target's scripts: scriptgen/NAME.py writes target NAME's, found by its file name.

Per-target knowledge lives in one module per target, found as targets are (``writer``):
scriptgen/NAME.py writes target NAME's cases, as kernel/targets/NAME.py is target NAME
(fuzzshard/targets.py); the helpers they share (common.py, dsd.py: the state-dict
checkpoint kinds, loop.py: the training loop, sync.py: the gradient sync controls) and
the package's own parts (plan.py, script.py, checks.py, this module) are
``_NOT_WRITERS``. Not a hook in each target's Spec: the kernel's target modules are
flattened into every fallback repro and imported in every worker, and this is
driver-only text generation that would weigh on both. A new target's writer is one module here, nothing else:
``unsupported(case, options)`` (why a case is not written, or None) and ``KINDS``
(the checkpoint kinds it writes) at the least, and for what it writes imports, shard,
optimizer, forward_backward, snapshot, grads and FREEZE_BEFORE_SHARD; the checkpoint
kinds of its own as save_<kind> / load_<kind>; REPLICAS where its snapshot lacks some
replicated quantities; ``objective(case, net, x)`` where the plain replay's loss is not
the loss on the whole batch (fsdp2's non-root term, pp's microbatches); LOOP (it
writes the training loop around the step), DTENSOR_GRADS (its grads are DTensors: a
total norm made full), SHARDED_SCALER (its grad scaler is ShardedGradScaler; SCALER_GROUP
the group it names), OWN_CLIP (the clip "own" is the model's clip_grad_norm_),
``global_loss(case, world)`` (ReduceLROnPlateau's loss where its ranks hold slices),
``grads_def(case, options)`` (the lines its grads expression calls) and
``joined_steps(case, options)`` (steps under Join: zero's uneven inputs).
A target with no module here falls back to the flattened kernel, saying so.
"""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil

# scriptgen/NAME.py is the writer of target NAME's scripts: adding one is adding its module (as
# kernel/targets/NAME.py is target NAME). Not writers: the helpers the writers share, and the package's own parts
# (the plan, the script's run and its check, this registry).
_NOT_WRITERS = {"common", "dsd", "loop", "sync", "plan", "script", "checks", "registry"}
_WRITTEN = sorted(m.name for m in pkgutil.iter_modules([os.path.dirname(__file__)]) if m.name not in _NOT_WRITERS)


@functools.lru_cache(maxsize=None)
def writer(target: str):
    """The module that writes ``target``'s scripts, or None (its repro is the flattened kernel)."""
    if target not in _WRITTEN:
        return None
    module = importlib.import_module(f"{__package__}.{target}")
    if not (callable(getattr(module, "unsupported", None)) and hasattr(module, "KINDS")):
        raise TypeError(f"{module.__name__} must define unsupported(case, options) and KINDS, as every writer does")
    return module


def writers() -> dict:
    """Every writer found: target name -> its module."""
    return {name: writer(name) for name in _WRITTEN}

