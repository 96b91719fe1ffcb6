"""A straight-line standalone repro: only what one finding uses, written out.

``straight_script(case, headline, environment, verdict)`` writes a short
torch-only script for ``torchrun``: the model as explicit nn modules, the
target's own calls, the optimizer with the kwargs that differ from torch's
defaults, the steps, the checkpoint's save and load, and then only the check
that the finding failed (``verdict``: the oracle, the step, the quantity):
  - an error (and a crash or a hang): the run up to where it raised, and
    nothing else: torch's own traceback is the evidence;
  - a checkpoint round trip: the state right before the save and right after
    the load, compared exactly;
  - parity: a plain copy of the model takes the sharded run's params and
    optimizer state before the step (anchored, as kernel/reference.py does),
    runs the step on the whole batch and steps from the sharded grads; the
    difference beyond the kernel's rounding bound (kernel/oracles.py) printed;
  - a replica divergence: after each step (and the load) every rank's copy of the
    quantity that diverged (grads, params, an optimizer state, a group's hyperparameter)
    gathered, and the ranks holding each copy and how far apart printed (bit for bit);
  - no verdict (a case, not a finding): parity at every step, or the round trip.
Cases it cannot write return None (``fallback_reason`` says why): repro.script falls
back to the flattened kernel and says so. The case's device and backend are one
variable (``device``: cpu with gloo, cuda with NCCL, one GPU per rank); the decoder
transformer is written out; a plugin's optimizer or model comes from the user's
plugin file, imported by the path the finding recorded (``environment["plugins"]``).
The training loop a case draws (kernel/loop.py: grad scaler, clip, LR scheduler, their
state beside the checkpoint) is written in torch's words on both sides (loop.py;
dtensor, tp, fsdp2, zero, pp and fsdp1: FSDP's own clip_grad_norm_).

The package, by concern: a finding's script is planned (plan.py), then written: its run (script.py), then
its check (checks.py), by the target's writer (registry.py finds it):
  script.py     ``straight_script`` and the Writer: the header, the imports, the prologue, each side's run and steps
  plan.py       ``plan_of``: what the script runs and checks, from the verdict's oracle; ``fallback_reason``:
                why it cannot be written
  checks.py     the check the script ends with: parity's replay within the kernel's bounds, the round trip, the
                replicas (the Writer's other half)
  registry.py   ``writer(NAME)``: the module that writes target NAME's scripts, and what a writer module defines
  NAME.py       target NAME's writer, one per target (dtensor.py is the smallest)
  common.py, dsd.py, loop.py, sync.py
                what the writers share: the model, batch and optimizer; DSD's checkpoint kinds; the training
                loop; the gradient sync controls
"""
from __future__ import annotations

from .plan import fallback_reason
from .registry import writer, writers
from .script import straight_script

__all__ = ["fallback_reason", "straight_script", "writer", "writers"]
