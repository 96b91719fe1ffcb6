"""Target ``pp``: pipeline parallelism, ``torch.distributed.pipelining``'s stages and schedules.

The built-in topology's top-level layers (``layers.0``, ``layers.1``, ...)
are cut into stages at the drawn ``cuts`` (the index of each stage's first
layer but the first's); the last stage also holds the output ``scale``
buffer and the ``unused`` submodule. The decoder (``--models decoder``) is
cut between its blocks, as torchtitan splits a Llama: the token embedding on
the first stage, the final norm and the output head on the last (a tied
head too: ``tie_span``; across ranks its grad is all-reduced between the
first and the last stage's ranks before the step, ``reduce_tied_grad``). Each stage is a ``PipelineStage`` over a
module that holds its layers under their plain names, on the rank the
schedule puts it: stage s on rank s for the single-stage schedules
(``GPipe``, ``1F1B``), on rank s mod W for the looped multi-stage ones
(``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``; ``stages``
per rank), and V-shaped for ``ZBVZeroBubble`` and ``DualPipeV`` (two per
rank: r and 2W-1-r). The schedule (``schedule``, among those the installed
torch has) runs ``n_microbatches`` microbatches of the whole batch (split by
``torch.tensor_split`` on dim 0, as the schedule splits it), the loss per
microbatch is the plain loss (a mean over the microbatch), and with
``scale_grads`` the schedule divides the summed microbatch grads by
``n_microbatches``. The reference (``objective``) trains the unsplit model on
the same microbatches: the sum of their losses, over ``n_microbatches`` with
``scale_grads``; the loss the run reports is that same sum or mean of the
last stage's losses. A config torch refuses (fewer microbatches than stages
for 1F1B and DualPipeV, a microbatch count that is not a multiple of the
rounds of the interleaved schedules, more microbatches than samples) is
invalid (``documented_refusal``), not a finding.

Each rank's optimizer is a plain torch.optim one over its own params, with
the case's param groups restricted to them (a group may be left empty, which
torch.optim takes). Every param, grad and state tensor is owned by one rank:
the observations give every rank full copies keyed by plain FQN, from one
``all_gather_object`` of every rank's own.
``target_options``: ``schedule``, ``stages`` (per rank), ``cuts``,
``scale_grads``, ``n_microbatches`` (drawn last, once the batch is known).

With FSDP2 (torchtitan's composition): on a 2-D mesh ``[pp, dp]`` (``dp``, the
mesh's second dim, in the options too: the reference reads it) the pipeline
runs on each dp index's pp group, and each stage's module is ``fully_shard``ed
on the dp sub-mesh (first the top-level layers named in ``wrap``, then the
stage's root, all with ``reshard_after_forward``, torchtitan's default under PP
False); the schedule drives FSDP2 (no sync but on the last backward, its
``perform_reduce_grad``). Each dp rank runs the pipeline on its slice of the
batch (``batch`` a multiple of ``dp``) and FSDP2's reduce-scatter averages the
grads over dp: the reference's objective is the mean over the dp slices of each
slice's. Gradient accumulation (``accum`` steps, torchtitan's
gradient_accumulation_steps): ``schedule.step`` on each of ``accum`` equal
parts of the slice before the optimizer step, the grads summed, but with
``scale_grads`` the schedule divides the model's whole grad by
``n_microbatches`` at the end of every step (``stage.scale_grads``: every
``p.grad``, the earlier steps' contributions too, as torchtitan #1733 met it):
the reference's objective is that recursion (``accumulate``), not a plain sum
or mean. Params, grads and state are gathered to full plain tensors over dp
(``full_tensor``), then over the stages as above.

With expert parallelism (``ep``, on [pp, dp] only, where every MoE's experts
divide over dp): each stage's MoE experts Shard(0) over the dp sub-mesh with
ep's ``ExpertParallel`` (its tokens dispatched and combined by all-to-all
over dp), left out of the stage's FSDP2 (``ignored_params``), their grads
divided by dp by a hook (the combine's backward sums them over the dp ranks'
tokens). Not with activation checkpointing or a checkpoint yet.

Dropout (``fuzz --dropout``; kernel/dropout.py): each rank seeds its
generator before the step from its row-major index on the mesh
(``dropout_rank``) and draws its stages' masks; the reference replays them
stage after stage (``replayed_stages``) under GPipe, 1F1B and LoopedBFS,
whose ranks draw in an order it follows; the schedules that interleave a
rank's stages are refused with dropout (the check).

The rooms (torchtitan splits a model's ``pipelining_fn`` from its
``parallelize_fn`` so):

- ``schedules.py``: the schedule catalog (what the installed torch has, what
  each refuses) and the stage arithmetic (which layers each stage holds, on
  which rank), and the objective a schedule step trains (the reference's).
- ``draws.py``: what a pp case may be: its draws, its check, its fit to
  another world size.
- ``describe.py``: what a pp case is beyond its fields: facts for a known
  finding's ``only_when``, coverage, where a tie runs.
- ``stages.py``: the modules a rank builds from the plain model: each stage's,
  and the rank's own part.
- ``target.py``: the adapter (``PPTarget``): stages and schedule on the
  pipeline's group, FSDP2 on [pp, dp], the gathered observations.
- ``checkpoint.py``: its checkpoint kinds, each rank's part through DCP.
"""
from __future__ import annotations

from .target import PPTarget

__all__ = ["PPTarget"]
