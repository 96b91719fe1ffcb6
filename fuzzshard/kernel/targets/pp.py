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
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ...case import Case
from ..model import loss_fn, named_params, param_shapes, submodule, tie_uses
from ..optim import build_optimizer, group_hparams, state_by_fqn
from ..state_io import UNEXPECTED_KEY, dcp_save, keys_of, without
from ...verdict import error_record
from ..ac import AC_NON_REENTRANT, apply_ac
from .base import Spec, Target

# the schedules, simplest first (shrinking goes there): name -> (stages per rank, style)
SCHEDULES = {
    "GPipe": ("single", "loop"),
    "1F1B": ("single", "loop"),
    "Interleaved1F1B": ("multi", "loop"),
    "LoopedBFS": ("multi", "loop"),
    "InterleavedZeroBubble": ("multi", "loop"),
    "ZBVZeroBubble": ("v", "v"),
    "DualPipeV": ("v", "v"),
}

# what torch says when it refuses a config by design (schedules.py, microbatch.py): such a case is invalid
REFUSALS = (
    "must be greater than or equal to the number of stages",  # Schedule1F1B
    "requires at least as many microbatches as stages",  # ScheduleDualPipeV
    "requires the number of microbatches to be a multiple of the number of rounds",  # Interleaved1F1B, ZB
    "is smaller than num_chunks",  # a batch of fewer samples than microbatches (_split_tensor)
)


def available() -> list[str]:
    """The schedules the installed torch has, in SCHEDULES' order."""
    import torch.distributed.pipelining as pipelining

    return [s for s in SCHEDULES if hasattr(pipelining, "Schedule" + s)]


def schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, "Schedule" + name)


def is_multi(name: str) -> bool:
    return SCHEDULES[name][0] != "single"


def pp_degree(options: dict, world: int) -> int:
    """The pipeline's ranks: the world, over ``dp`` on a [pp, dp] mesh."""
    return world // options.get("dp", 1)


def n_stages(options: dict, world: int) -> int:
    return pp_degree(options, world) * options.get("stages", 1)


def stage_ranks(options: dict, world: int) -> list[int]:
    """The pp rank of each stage (torch's generate_stage_to_rank_mapping, loop or V style)."""
    n, pp = n_stages(options, world), pp_degree(options, world)
    if SCHEDULES[options["schedule"]][1] == "v":
        out, r = [], 0
        for s in range(n):
            out.append(r)
            if (s + 1) % pp:
                r += 1 if (s // pp) % 2 == 0 else -1
        return out
    return [s % pp for s in range(n)]


def stage_layers(options: dict, n_layers: int) -> list[list[int]]:
    """The top-level layer indices of each stage."""
    bounds = [0, *options["cuts"], n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stages_per_rank(name: str, world: int, n_layers: int) -> list[int]:
    """The stage counts per rank a schedule may take with this many top-level layers."""
    kind = SCHEDULES[name][0]
    if kind == "single":
        choices = [1]
    elif kind == "v":
        choices = [2]  # "ZBV requires exactly 2 stages per rank"
    else:
        choices = [2, 3]
    return [c for c in choices if world * c <= n_layers]


def n_units(model) -> int:
    """What the stages are cut from: a topology's top-level layers, the decoder's blocks."""
    return model.sizes["n_layers"] if model.factory == "decoder" else len(model.layers)


def uncuttable(model) -> str | None:
    """Why a model cannot be cut into stages, or None."""
    if model.factory == "decoder":
        return None
    if model.factory:
        return "pp cuts a topology's top-level layers or the decoder's blocks; a plugin's model has none to cut"
    return None


def tie_span(case: Case) -> str:
    """Where a tied weight's two uses (the embedding on the first stage, the head on the last) live: "" untied
    or one stage, "ranks" on two ranks (their grads all-reduced between them before the step, as Megatron-LM's
    embedding group does), "stages" on two stages of one rank (V schedules, or one pp rank: one param in both
    stage modules)."""
    if not tie_uses(case.model) or n_stages(case.target_options, case.world_size) < 2:
        return ""
    ranks = stage_ranks(case.target_options, case.world_size)
    return "ranks" if ranks[0] != ranks[-1] else "stages"


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """A schedule the installed torch has that the model's top-level layers
    (the decoder's blocks) can fill (one or more per stage), its stages per
    rank, the cut points, scale_grads. A model with fewer of them than ranks
    (or a plugin's model, a tied head) cannot be cut: rejected. On a
    2-D mesh [pp, dp], FSDP2 on each stage: ``dp``, ``reshard_after_forward``,
    the top-level layers with their own fully_shard (``wrap``); drawn after the
    rest, and only there, so the 1-D draws stay as they were."""
    import hypothesis.strategies as st
    from hypothesis import assume

    model = context["model"]
    assume(len(mesh_shape) <= 2)
    world = mesh_shape[0]
    n = n_units(model)
    assume(uncuttable(model) is None and n >= world)
    names = [s for s in available() if stages_per_rank(s, world, n)]
    schedule = draw(st.sampled_from(names))
    stages = draw(st.sampled_from(stages_per_rank(schedule, world, n)))
    total = world * stages
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=total - 1, max_size=total - 1, unique=True))) \
        if total > 1 else []
    out = {"schedule": schedule, "cuts": cuts, "scale_grads": draw(st.booleans())}
    if stages > 1:
        out["stages"] = stages
    if len(mesh_shape) == 2:
        out["dp"] = mesh_shape[1]
        out["reshard_after_forward"] = draw(st.booleans())  # torchtitan's default under PP: False
        wrap = [f"layers.{i}" for i in range(n) if draw(st.booleans())]
        if wrap:
            out["wrap"] = wrap
    return out


def accepts(name: str, n_microbatches: int, world: int, stages: int) -> bool:
    """Whether Schedule<name> takes this many microbatches (what its constructor checks)."""
    if name in ("1F1B", "DualPipeV"):
        return n_microbatches >= world * stages
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return n_microbatches % max(1, n_microbatches // world) == 0
    return True


def draw_late_options(draw, case: Case) -> dict:
    """``n_microbatches``, once the batch is known: three times in four a
    divisor of the batch (each dp rank's slice of it on a [pp, dp] mesh, which
    must divide it) that the schedule takes (equal microbatches; any
    divisor where none is taken), else any count up to one past the batch
    (unequal microbatches, which torch's split makes; fewer than 1F1B's
    stages, or one past the batch: torch refuses them, an invalid case).
    Then ``accum``, where the slice splits into that many equal parts of
    ``n_microbatches`` samples or more (drawn last: the draws before stay)."""
    import hypothesis.strategies as st
    from hypothesis import assume

    opts = dict(case.target_options)
    if "schedule" in opts:
        dp = opts.get("dp", 1)
        assume(case.batch % dp == 0)
        batch = case.batch // dp
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        pp = pp_degree(opts, case.world_size)
        taken = [d for d in divisors if accepts(opts["schedule"], d, pp, opts.get("stages", 1))]
        if draw(st.integers(0, 3)):
            opts["n_microbatches"] = draw(st.sampled_from(taken or divisors))
        else:
            opts["n_microbatches"] = draw(st.integers(1, batch + 1))
        accums = [a for a in (1, 2, 3) if batch % a == 0 and batch // a >= opts["n_microbatches"]]
        if len(accums) > 1:
            accum = draw(st.sampled_from(accums))
            if accum > 1:
                opts["accum"] = accum
    return opts


def check(case: Case) -> str | None:
    """What makes a pp case impossible: a model the stages cannot hold, cuts that do not make one non-empty
    stage per stage index."""
    o = case.target_options
    if uncuttable(case.model):
        return uncuttable(case.model)
    if len(case.mesh_shape) > 2:
        return f"pp runs on a 1-D mesh [pp] or a 2-D one [pp, dp], not {list(case.mesh_shape)}"
    dp = case.mesh_shape[1] if len(case.mesh_shape) == 2 else None
    if o.get("dp") != dp:
        return f"pp: dp {o.get('dp')} is not the mesh {list(case.mesh_shape)}'s second dim" if dp else \
            "pp: dp (FSDP2 over the mesh's second dim) needs a 2-D mesh [pp, dp]"
    if not dp and any(k in o for k in ("wrap", "reshard_after_forward")):
        return "pp: wrap and reshard_after_forward are FSDP2's, on a 2-D mesh [pp, dp]"
    if dp and case.batch % dp:
        return f"pp: each of the {dp} dp ranks trains on an equal slice of the batch ({case.batch})"
    accum = o.get("accum", 1)
    if type(accum) is not int or accum < 1 or (case.batch // (dp or 1)) % accum:
        return f"pp: accum {accum} must be a positive int dividing each dp rank's slice of the batch"
    if case.checkpoint:
        problem = check_checkpoint(case)
        if problem:
            return problem
    name = o.get("schedule")
    if name not in SCHEDULES:
        return f"pp: unknown schedule {name!r} (one of {list(SCHEDULES)})"
    if name not in available():
        return f"pp: this torch has no Schedule{name}"
    stages = o.get("stages", 1)
    if stages not in ({1} if not is_multi(name) else {2} if SCHEDULES[name][0] == "v" else {2, 3}):
        return f"pp: Schedule{name} takes {'1' if not is_multi(name) else '2'} stage(s) per rank, not {stages}"
    n, total = n_units(case.model), n_stages(o, case.world_size)
    if not set(o.get("wrap", ())) <= {f"layers.{i}" for i in range(n)}:
        return f"pp: wrap {o['wrap']} names modules that are not top-level layers"
    if n < total:
        return f"pp: {total} stages need {total} top-level layers or more, the model has {n}"
    cuts = o.get("cuts", [])
    if len(cuts) != total - 1 or cuts != sorted(set(cuts)) or (cuts and not 0 < cuts[0] <= cuts[-1] < n):
        return f"pp: cuts {cuts} do not split {n} top-level layers into {total} non-empty stages"
    if not isinstance(o.get("n_microbatches"), int) or o["n_microbatches"] < 1:
        return "pp: n_microbatches must be a positive int"
    if dp and tie_span(case) == "stages":
        return ("pp: a tied weight on two stages of one rank under FSDP2: each stage module is a fully_shard root of "
                "its own, and FSDP2 keeps a shared param in one group only (fully_shard([a, b]))")
    return None


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """Another world size: the first cuts, as many as its stages need (the check refuses too few); ``dp``
    the mesh's second dim (FSDP2's options dropped on a 1-D mesh)."""
    if len(mesh_shape) == 2:
        options["dp"] = mesh_shape[1]
        options.setdefault("reshard_after_forward", False)
    else:
        for key in ("dp", "wrap", "reshard_after_forward"):
            options.pop(key, None)
    if "cuts" in options:
        options["cuts"] = options["cuts"][:n_stages(options, math.prod(mesh_shape)) - 1]
    return options


# ---- checkpoints: each stage's rank saves its own part through DCP, the loading side at another pp degree ----

# how each kind saves and loads (Spec.checkpoint_kinds; kernel/state_io.py's STATE_DICT_KINDS name the same "dcp")
CHECKPOINT_KINDS = {
    "dcp": "torchtitan's pipeline checkpoint: each rank's model part (its stages' layers, the output scale on the last "
           "stage's rank) by get_model_state_dict and its optimizer by get_optimizer_state_dict("
           "flatten_optimizer_state_dict=True), plain FQN keys, dcp.save to one directory; dcp.load into the loading "
           "side's parts at another pp degree (world size, schedule, cuts), set_state_dict or the split setters",
}


def check_checkpoint(case: Case) -> str | None:
    """What makes a pp checkpoint impossible: a kind pp has not, an LR scheduler (each rank's scheduler holds
    its own groups' lrs under the same DCP keys: the scheduler state does not reshard across stages), or a
    loading side that is no pp case of its own (its world size, mesh and target options, checked as the saving
    side's)."""
    ck = case.checkpoint
    if ck.kind not in CHECKPOINT_KINDS:
        return f"pp checkpoints are of kind {list(CHECKPOINT_KINDS)}, not {ck.kind!r}"
    if case.lr_scheduler:
        return ("pp: a checkpoint with an LR scheduler (each rank's scheduler holds its own groups' lrs under the "
                "same keys: its state does not reshard across stages)")
    saving = dataclasses.replace(case, checkpoint=None)
    loading = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=tuple(ck.mesh_shape),
                                  target_options=ck.target_options, checkpoint=None)
    for side, what in ((saving, "the saving side"), (loading, "the loading side")):
        problem = check(side)
        if problem:
            return f"{what}: {problem}"
        empty = stateless_ranks(side)
        if empty:
            return (f"pp: {what}'s rank(s) {empty} optimize no param (their stages' layers have none in a group): "
                    "get_optimizer_state_dict refuses an empty optimizer state dict by design")
    return None


def stateless_ranks(case: Case) -> list[int]:
    """The pipeline ranks whose optimizer holds no param (their stages' layers, and the decoder's ends, have
    none in a param group, or none at all): DSD refuses the empty optimizer state dict (and an empty model
    state dict) by design."""
    o, names = case.target_options, {n for g in case.groups for n in g.params}
    rank_of = stage_ranks(o, case.world_size)
    last = len(rank_of) - 1

    def holds(s: int, layers: list[int]) -> bool:
        prefixes = [f"layers.{i}." for i in layers] + ["tok_embeddings."] * (s == 0) \
            + ["norm.", "output.", "unused."] * (s == last) + [f"{u}." for u in tie_uses(case.model)[:1]] * (s == last)
        return any(n.startswith(p) for p in prefixes for n in names)

    held = {rank_of[s] for s, layers in enumerate(stage_layers(o, n_units(case.model))) if holds(s, layers)}
    return sorted(set(range(pp_degree(o, case.world_size))) - held)


def draw_late_options_both_sides(draw, case: Case) -> dict:
    """``draw_late_options`` for the case, and for a checkpoint's loading side its own microbatch count (its own
    schedule at its own world size): one the schedule takes, a divisor of the batch where one is taken, else
    any count up to the batch it takes (unequal microbatches), else a divisor (refused: an invalid case). The
    saving side's draw explores torch's refusals; the loading side's would only double them. The count is
    written into the checkpoint's target options (a dict drawn for this case alone; the late draw returns the
    saving side's). A checkpoint where a side's rank would hold no state (``stateless_ranks``) is rejected."""
    import hypothesis.strategies as st
    from hypothesis import assume

    out = draw_late_options(draw, case)
    ck = case.checkpoint
    if ck is not None and "schedule" in ck.target_options:
        loading = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=tuple(ck.mesh_shape),
                                      target_options=ck.target_options, checkpoint=None)
        assume(not stateless_ranks(case) and not stateless_ranks(loading))
        lo = ck.target_options
        assume(case.batch % lo.get("dp", 1) == 0)  # each dp rank's slice of the batch, as the saving side's
        batch = case.batch // lo.get("dp", 1)
        pp = pp_degree(lo, ck.world_size)
        counts = range(1, batch + 1)
        takes = [n for n in counts if accepts(lo["schedule"], n, pp, lo.get("stages", 1))]
        divisors = [n for n in counts if batch % n == 0]
        lo["n_microbatches"] = draw(st.sampled_from([n for n in takes if n in divisors] or takes or divisors))
    return out


# the schedules that split a stage's backward into input and weight parts (stage_backward_input / _weight)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def facts(case: Case) -> dict:
    """What a pp case is beyond its fields, for a known finding's ``only_when``: whether its microbatches are
    unequal, whether a split-backward schedule meets a stage whose input needs no grad (no trainable param
    before it), or FSDP2 stages resharded after forward."""
    o = case.target_options
    n_mb = o.get("n_microbatches") or 0
    out = {"schedule": o.get("schedule"), "n_stages": n_stages(o, case.world_size),
           "n_microbatches": n_mb, "scale_grads": o.get("scale_grads"),
           "uneven_microbatches": bool(n_mb) and (case.batch // o.get("dp", 1) // o.get("accum", 1)) % n_mb != 0,
           "dp": o.get("dp", 1), "accum": o.get("accum", 1),
           "split_backward_input_without_grad": o.get("schedule") in SPLIT_BACKWARD and _input_without_grad(case),
           # FSDP2 resharding a stage after its forward: its input backward sees the sharded params (known/)
           "split_backward_fsdp_resharded": o.get("schedule") in SPLIT_BACKWARD and bool(o.get("dp"))
           and bool(o.get("reshard_after_forward"))}
    # either way stage_backward_input finds no path to the weights: a stage's grads may all vanish
    out["split_backward_no_weight_path"] = out["split_backward_input_without_grad"] or out["split_backward_fsdp_resharded"]
    # a tied weight in two stage modules of one rank, each stage's scale_grads dividing it (torch: once per stage)
    out["tie_stages_scaled"] = tie_span(case) == "stages" and bool(o.get("scale_grads")) and n_mb > 1
    return out


def _input_without_grad(case: Case) -> bool:
    """At some step, some stage after the first has no trainable param before it (every layer before it frozen
    or parameter-free): the case's frozen params, then each step's freezes and unfreezes, as they are applied
    before that step."""
    if not case.target_options.get("cuts") or uncuttable(case.model):
        return False
    # the unit of each param before the last stage's end: layers.<i> -> i, the decoder's embedding -> -1
    unit = {n: int(n.split(".")[1]) if n.startswith("layers.") else -1 for n in param_shapes(case.model)
            if n.startswith(("layers.", "tok_embeddings."))}
    frozen = set(case.frozen)
    for step in case.schedule or (None,):
        if step is not None:
            frozen = (frozen | set(step.freeze)) - set(step.unfreeze)
        trainable = {i for n, i in unit.items() if n not in frozen}
        if any(not any(i < start for i in trainable) for start in case.target_options["cuts"]):
            return True
    return False


def pp_tie(case: Case) -> str:
    """Where the tie's two uses run (tie_span)."""
    if not tie_uses(case.model):
        return ""
    return {"": "one stage", "ranks": "across ranks, grad all-reduced",
            "stages": "two stages of one rank"}[tie_span(case)]


def coverage(case: Case) -> dict:
    o = case.target_options
    fsdp = f" FSDP2 [{pp_degree(o, case.world_size)},{o['dp']}]" if o.get("dp") else ""
    return {"schedule x world": [f"{o.get('schedule')} W{case.world_size}{fsdp}"],
            "accum x scale_grads": [f"accum {o.get('accum', 1)} scale_grads {bool(o.get('scale_grads'))}"]}


def coverage_with_checkpoint(case: Case) -> dict:
    """``coverage``, and for a checkpoint the pp degree it resharded across: the stages saved -> loaded (the
    loading side's own schedule, stages per rank and cuts)."""
    out = coverage(case)
    ck = case.checkpoint
    if ck is not None:
        out["checkpoint stages saved -> loaded"] = [
            f"{n_stages(case.target_options, case.world_size)} -> {n_stages(ck.target_options, ck.world_size)}"]
    return out


def facts_with_checkpoint(case: Case) -> dict:
    """``facts``, where the steps after a checkpoint's load count too: they run the loading side's schedule,
    stages and microbatches (unequal ones there, or a split-backward schedule there meeting a stage whose input
    needs no grad, from the flags the steps before the load left)."""
    out = facts(case)
    ck = case.checkpoint
    if ck is not None and "schedule" in ck.target_options and ck.after + 1 < len(case.schedule):
        frozen = set(case.frozen)
        for step in case.schedule[:ck.after + 1]:
            frozen = (frozen | set(step.freeze)) - set(step.unfreeze)
        loading = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=tuple(ck.mesh_shape),
                                      target_options=ck.target_options, checkpoint=None,
                                      frozen=tuple(sorted(frozen)), schedule=case.schedule[ck.after + 1:])
        theirs = facts(loading)
        for key in ("uneven_microbatches", "split_backward_input_without_grad", "split_backward_fsdp_resharded",
                    "split_backward_no_weight_path", "tie_stages_scaled"):
            out[key] = out[key] or theirs[key]
    return out


def microbatch_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The loss of each microbatch, split as the schedule splits the batch (tensor_split on dim 0)."""
    return [loss_fn(model(xm), ym) for xm, ym in zip(torch.tensor_split(x, n, 0), torch.tensor_split(y, n, 0))]


def combine(losses, options: dict) -> torch.Tensor:
    """The schedule's objective over its microbatch losses: their mean with scale_grads, else their sum."""
    total = sum(losses[1:], losses[0])
    return total / len(losses) if options.get("scale_grads") else total


def accumulate(steps, options: dict) -> torch.Tensor:
    """The objective of several schedule steps' microbatch losses (``accum``), whose grads add up in
    ``p.grad``: their sum, but with scale_grads each step ends by dividing the whole grad (the earlier steps'
    too: stage.scale_grads) by n_microbatches, so step a of A counts 1 / n_microbatches^(A - a)."""
    total = None
    for losses in steps:
        total = combine(losses, options) if total is None else combine([total + losses[0], *losses[1:]], options)
    return total


def pp_objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
    """The unsplit model on what the pipeline trains: each dp rank's equal slice of the batch, in ``accum``
    equal parts, each split into ``n_microbatches`` microbatches (``accumulate``); the mean over the dp
    slices (FSDP2's reduce-scatter averages)."""
    dp, n = options.get("dp", 1), options["n_microbatches"]
    per = []
    for xd, yd in zip(torch.tensor_split(x, dp, 0), torch.tensor_split(y, dp, 0)):
        parts = zip(torch.tensor_split(xd, options.get("accum", 1), 0), torch.tensor_split(yd, options.get("accum", 1), 0))
        per.append(accumulate([microbatch_losses(model, xa, ya, n) for xa, ya in parts], options))
    return per[0] if dp == 1 else sum(per[1:], per[0]) / dp


def stage_ends(model: nn.Module, s: int, last: int) -> dict:
    """The decoder's modules around its blocks, as torchtitan splits it: the token embedding on the first
    stage, the final norm and the output head on the last; a topology's tied head on the last."""
    if not hasattr(model, "tok_embeddings"):
        return {"head": model.head} if s == last and hasattr(model, "head") else {}
    return {**({"tok_embeddings": model.tok_embeddings} if s == 0 else {}),
            **({"norm": model.norm, "output": model.output} if s == last else {})}


class _StageModule(nn.Module):
    """One stage: its layers under their plain names (``layers.<i>``), on
    the last stage the output scale (a buffer); a decoder's stage has its
    ``stage_ends`` too."""

    def __init__(self, layers: dict, scale: torch.Tensor | None, ends: dict):
        super().__init__()
        for name, module in ends.items():
            setattr(self, name, module)
        self.layers = nn.ModuleDict(layers)
        if scale is not None:
            self.register_buffer("scale", scale)

    def forward(self, x):
        if hasattr(self, "tok_embeddings"):
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if hasattr(self, "output"):
            x = self.output(self.norm(x))
        if hasattr(self, "head"):
            x = self.head(x)
        if hasattr(self, "scale"):
            x = x * self.scale
        return x


class _Local(nn.Module):
    """This rank's part of the model: every layer of its stages under its
    plain name (and ``unused``, on the last stage's rank); what the optimizer
    and the observations see. ``tie``: on a rank holding the tied head but not
    the first stage, the tied weight (as the head's stage module holds it)
    under its owner's FQN, first: the name the case's groups and the
    observations give it."""

    def __init__(self, layers: dict, unused: nn.Module | None, ends: dict, tie: tuple | None = None):
        super().__init__()
        if tie and tie[0] != "layers.0":
            self.add_module(tie[0], _Holder(tie[1]))
        for name, module in ends.items():
            if name != "head":
                setattr(self, name, module)
        self.layers = nn.ModuleDict(({"0": _Holder(tie[1])} if tie and tie[0] == "layers.0" else {}) | layers)
        if "head" in ends:  # after the layers: the tied weight's name is layers.0's, as in the whole model
            self.head = ends["head"]
        if unused is not None:
            self.unused = unused


class _Holder(nn.Module):
    """A module holding a tied weight under the name ``weight`` (never run)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class PPTarget(Target):
    name = "pp"
    spec = Spec(moe={"whole_batch": False, "microbatched": True, "aux": False, "bias": False}, options=draw_options, checkpoint_kinds=CHECKPOINT_KINDS, named_params=True,
                late_options=draw_late_options_both_sides, check=check, fit_options=fit_options,
                facts=facts_with_checkpoint, coverage=coverage_with_checkpoint, component="pipelining",
                lr_scheduler=True, lr_scheduler_checkpoint=False, max_depth=8,
                # activation checkpointing inside each stage, non-reentrant only (the zero-bubble schedules'
                # split backward calls torch.autograd.grad, which reentrant checkpoint does not support)
                ac=AC_NON_REENTRANT, tie=pp_tie)
    localizable = False  # a rank runs only its stages' modules, once per microbatch

    @classmethod
    def objective(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
        """The unsplit model on the schedule's microbatches: the mean of their
        losses with scale_grads (the schedule divides the summed grads by
        their number), else their sum; with ``dp`` and ``accum``, pp_objective."""
        return pp_objective(model, x, y, options)

    @classmethod
    def documented_refusal(cls, case: Case, error: dict) -> bool:
        """torch refuses the schedule's config by design (REFUSALS): an invalid case."""
        return error.get("type") in ("ValueError", "AssertionError") and any(
            r in error.get("message", "") for r in REFUSALS)

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        # the pipeline's group: the mesh's, or on a [pp, dp] mesh this dp index's pp group
        self.group = mesh.get_group(0) if mesh.ndim == 2 else mesh.get_group()
        self.dp_group = mesh.get_group(1) if mesh.ndim == 2 else None
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        o = case.target_options
        self.layers_of = stage_layers(o, n_units(case.model))
        self.rank_of = stage_ranks(o, case.world_size)
        self.mine = [s for s, r in enumerate(self.rank_of) if r == self.rank]
        self.last_rank = self.rank_of[-1]

    def shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage

        o = self.case.target_options
        apply_ac(model, o)  # before the stages take its layers (kernel/ac.py)
        device = next((p.device for p in model.parameters()), torch.device(self.case.device))
        last = len(self.rank_of) - 1
        scale = getattr(model, "scale", None)
        self.stages = []
        local, ends = {}, {}
        for s in self.mine:
            layers = {str(i): model.layers[str(i) if isinstance(model.layers, nn.ModuleDict) else i]
                      for i in self.layers_of[s]}
            local.update(layers)
            ends.update(stage_ends(model, s, last))
            module = _StageModule(layers, scale if s == last else None, stage_ends(model, s, last))
            if o.get("dp"):
                self._fully_shard(module)
            self.stages.append(PipelineStage(module, s, len(self.rank_of), device, group=self.group))
        cls = schedule_class(o["schedule"])
        kw = {"n_microbatches": o["n_microbatches"], "loss_fn": loss_fn, "scale_grads": bool(o.get("scale_grads"))}
        self.schedule = cls(self.stages, **kw) if is_multi(o["schedule"]) else cls(self.stages[0], **kw)
        unused = getattr(model, "unused", None) if self.rank == self.last_rank else None
        tie = None
        self.tie_span = tie_span(self.case)
        if self.tie_span == "ranks" and self.rank == self.last_rank:  # the head's weight, as its stage holds it now
            owner, head = tie_uses(self.case.model)
            tie = (owner, self.stages[self.mine.index(last)].submod.get_submodule(head).weight)
        return _Local(local, unused, ends, tie)

    def reduce_tied_grad(self, model: nn.Module) -> None:
        """A tie across ranks: the tied weight's grad summed over the first and the last stage's ranks (each
        holds its use's part), as Megatron-LM's embedding group all-reduces the word embeddings' grads before
        the step. Over the pipeline's group, the ranks between them adding zeros (exact): a group of the two
        ranks alone is what a user makes (the repro script does), which the pool's fixed groups may not hold."""
        from torch.distributed.tensor import DTensor

        if self.tie_span != "ranks":
            return
        owner = tie_uses(self.case.model)[0] + ".weight"
        p = named_params(model).get(owner) if self.rank in (0, self.last_rank) else None
        g = p.grad if p is not None else None
        local = g.to_local() if isinstance(g, DTensor) else g
        buf = local.detach().clone() if local is not None else torch.zeros(self._tied_local_shape(),
                                                                            dtype=getattr(torch, self.case.dtype),
                                                                            device=self.case.device)
        dist.all_reduce(buf, group=self.group)
        if local is not None:
            local.copy_(buf)

    def _tied_local_shape(self) -> tuple:
        """This rank's share of the tied weight: whole, or under FSDP2 its dim-0 chunk over dp (FSDP2's torch.chunk)."""
        shape = param_shapes(self.case.model)[tie_uses(self.case.model)[0] + ".weight"]
        if self.dp_group is None:
            return shape
        chunks = torch.empty(shape, device="meta").chunk(dist.get_world_size(self.dp_group), 0)
        r = dist.get_rank(self.dp_group)
        return tuple(chunks[r].shape) if r < len(chunks) else (0, *shape[1:])

    def _fully_shard(self, module: nn.Module) -> None:
        """FSDP2 on the dp sub-mesh, as torchtitan's parallelize does to each model part: the ``wrap`` layers
        of this stage first, then the stage's module (the FSDPModule the schedule drives)."""
        from torch.distributed.fsdp import fully_shard

        o = self.case.target_options
        kw = {"mesh": self.mesh["d1"], "reshard_after_forward": bool(o.get("reshard_after_forward"))}
        for fqn in o.get("wrap", ()):
            if fqn.split(".")[1] in module.layers:
                fully_shard(submodule(module, fqn), **kw)
        fully_shard(module, **kw)

    @property
    def dp_dims(self) -> list[int]:
        """The batch is split over the mesh's dp dim (the second), not over the pipeline's."""
        return [1] if self.mesh.ndim == 2 else []

    def batch_groups(self) -> list:
        return [self.dp_group] if self.dp_group is not None else []

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step (``accum`` steps, on equal parts of it) on this dp rank's slice of the batch
        (the whole batch without dp; the inputs on the first stage's rank, the targets everywhere, as
        torchtitan passes them); the last stage's microbatch losses combined as ``objective`` does,
        sent to every rank of the pipeline, averaged over dp."""
        o = self.case.target_options
        dp, accum = o.get("dp", 1), o.get("accum", 1)
        xd, yd = torch.tensor_split(x, dp, 0)[self.dp_rank()], torch.tensor_split(y, dp, 0)[self.dp_rank()]
        steps = []
        for xa, ya in zip(torch.tensor_split(xd, accum, 0), torch.tensor_split(yd, accum, 0)):
            losses = []
            if 0 in self.mine:
                self.schedule.step(xa, target=ya, losses=losses)
            else:
                self.schedule.step(target=ya, losses=losses)
            steps.append([loss.detach().double() for loss in losses])
        self.reduce_tied_grad(model)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        if self.rank == self.last_rank:
            total = accumulate(steps, o)
        dist.broadcast(total, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
            total = total / dp
        return total.to(getattr(torch, self.case.dtype))

    def set_requires_grad(self, model: nn.Module, fqns, flag: bool) -> None:
        params = named_params(model)
        for n in fqns:
            if n in params:  # another rank's param: that rank sets it
                params[n].requires_grad_(flag)

    def _everywhere(self, mine: dict) -> dict:
        """{fqn: value} of every rank's own, on every rank, in the plain model's param order."""
        parts = [None] * self.world
        dist.all_gather_object(parts, {n: _cpu(v) for n, v in mine.items()}, group=self.group)
        merged = {}
        for part in parts:  # the lowest rank's copy of a value two ranks hold (a tie across ranks) ...
            for n, v in part.items():
                merged.setdefault(n, v)
        merged.update(parts[self.rank])  # ... but a rank's own copy where it holds one: the replica oracle compares them
        order = self._order()
        return {n: merged[n] for n in sorted(merged, key=lambda n: order.get(n, len(order)))}

    def _order(self) -> dict:
        return {n: i for i, n in enumerate(param_shapes(self.case.model))}

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """FSDP2's sharded DTensor, whole (a collective over dp); a plain tensor as it is."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    def params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._everywhere({n: self.full(p.detach()) for n, p in named_params(model).items()})

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        return self._everywhere({n: None if p.grad is None else self.full(p.grad.detach())
                                 for n, p in named_params(model).items()})

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        return self._everywhere(state_by_fqn(opt, model, self.full))

    def noncontiguous_grads(self, model: nn.Module) -> list[str]:
        """The grads some rank's step reads non-contiguous (FSDP2's: its local shard), over the pipeline, then dp."""
        from torch.distributed.tensor import DTensor

        local = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in named_params(model).items()}
        mine = sorted(n for n, g in local.items() if g is not None and not g.is_contiguous())
        for group in (self.group, self.dp_group):
            if group is not None:
                parts = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, mine, group=group)
                mine = sorted({n for part in parts for n in part})
        return mine

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        """The case's groups over this rank's params only. A group with none of
        them is left out (torch.optim refuses a group without names beside named
        ones), unless the case's group is empty itself (the reference has it too)
        or the rank has no params at all (then the first group, empty: torch.optim
        refuses an optimizer without groups). ``group_hparams`` puts them back
        together in the case's order."""

        local = named_params(model)
        groups = [dataclasses.replace(g, params=tuple(n for n in g.params if n in local)) for g in self.case.groups]
        self.group_index = [i for i, (g, mine) in enumerate(zip(self.case.groups, groups))
                            if mine.params or not g.params]
        if not self.group_index:
            self.group_index = [0]
        kept = tuple(groups[i] for i in self.group_index)
        return build_optimizer(model, dataclasses.replace(self.case, groups=kept), lr_scale)

    def group_hparams(self, opt) -> list[dict]:
        """Every case group's hyperparameters, from a rank whose optimizer holds
        its params (the lowest), else from one that holds it empty."""
        return self._in_case_order(opt, group_hparams(opt))

    def _in_case_order(self, opt, values: list) -> list:
        """One value per group of this rank's optimizer -> one per case group, in the case's order, each from
        the lowest rank whose optimizer holds the group's params, else from one that holds it empty (a
        collective over the pipeline's ranks)."""
        mine = [(i, bool(g["params"]), v) for i, g, v in zip(self.group_index, opt.param_groups, values)]
        parts = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        out = {}
        for has in (True, False):
            for part in parts:
                for i, full, v in part:
                    if full == has and i not in out:
                        out[i] = v
        return [out[i] for i in sorted(out)]

    def loop(self, opt, model: nn.Module):
        """The training loop (kernel/loop.py) over this rank's optimizer: an LR scheduler steps each rank's
        groups; its last lrs are observed per case group, in the case's order, as the reference's one scheduler
        over all of them. No clipping: a norm over every stage's grads needs a reduction across the stages that
        torch's clip_grad_norm_ does not make (torchtitan #596); no grad scaler (the schedule runs backward)."""
        loop = super().loop(opt, model)
        observe = loop.observe

        def observe_in_case_order() -> dict:
            out = observe()
            if "last_lr" in out:
                out["last_lr"] = torch.tensor(self._in_case_order(opt, out["last_lr"].tolist()), dtype=torch.float64)
            return out

        loop.observe = observe_in_case_order
        return loop

    # -- checkpoints (CHECKPOINT_KINDS): torchtitan's, each rank its own model part and optimizer by plain FQN --

    def _part(self, model: nn.Module) -> nn.Module:
        """This rank's model part as it is saved and loaded: what the optimizer is over (its stages' layers, the
        decoder's ends, ``unused``) and, on the last stage's rank, the output ``scale`` buffer (a stage module's,
        the same tensor: a load fills it in place), all under their plain FQNs."""
        part = nn.Module()
        for name, child in model.named_children():
            part.add_module(name, child)
        for stage in self.stages:
            if hasattr(stage.submod, "scale"):
                part.register_buffer("scale", stage.submod.scale)
        return part

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        """Collective over the saving job: every rank's part and its flattened optimizer state dict (one key per
        param and state or hyperparameter, so each stage's keys are its own) in one DCP checkpoint."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        part = self._part(model)
        sd = {}

        def state_dicts():
            sd["model"] = get_model_state_dict(part)
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            sd["optim"] = get_optimizer_state_dict(part, opt, options=flat)

        self._together(state_dicts, group)  # (before dcp.save's collectives: no rank enters them alone)
        dcp_save(self.case, sd, os.path.join(path, "dcp"), group)
        return None

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        """Collective over the loading job: the fresh part's and optimizer's own state dicts (the keys this rank
        holds at the loading side's pp degree) filled by ``dcp.load``, then set back, split or not, strict or
        not; a missing param is one this rank does not ask for. A rank whose own part of the load raises makes
        every rank raise (``_together``), as a job whose rank fails stops whole."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict, set_state_dict)

        ck = self.case.checkpoint
        part = self._part(model)
        sd = {}

        def state_dicts():  # the layout to load into
            sd["model"] = without(get_model_state_dict(part), keys_of(part, ck.missing))
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            sd["optim"] = get_optimizer_state_dict(part, opt, options=flat)

        def set_back():
            msd = dict(sd["model"])
            if ck.unexpected:
                msd[UNEXPECTED_KEY] = torch.zeros(2)
            options = StateDictOptions(strict=ck.strict, flatten_optimizer_state_dict=True)
            if ck.split:
                set_model_state_dict(part, msd, options=options)
                set_optimizer_state_dict(part, opt, sd["optim"], options=options)
            else:
                set_state_dict(part, opt, model_state_dict=msd, optim_state_dict=sd["optim"], options=options)

        self._together(state_dicts, group)  # (before dcp.load's collectives: no rank enters them alone)
        # DCP's collectives raise on every rank where one fails
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), process_group=group)
        self._together(set_back, group)

    def _together(self, fn, group) -> None:
        """``fn()`` on every rank of ``group``; where it raised on some, every rank raises a CheckpointException
        holding each failed rank's error (as DCP's own collectives raise: the lowest failed rank's error is the
        one a verdict reads, with that rank's traceback), so no rank waits in a collective for one whose load
        failed."""
        import traceback

        from torch.distributed.checkpoint.api import CheckpointException

        error = None
        try:
            fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException (it raises it on every rank)
            error = e
        failed = [None] * dist.get_world_size(group)
        said = None if error is None else error_record(error)  # (a CheckpointException's: its first failure's)
        dist.all_gather_object(failed, None if said is None else (said["type"], said["message"], said["traceback"]),
                               group=group)
        if all(f is None for f in failed):
            return
        me = dist.get_rank(group)
        failures = {}
        for r, f in enumerate(failed):
            if r == me and error is not None:
                failures[r] = (error, traceback.extract_tb(error.__traceback__))
            elif f is not None:  # another rank's error: its type, its message's first line (the signature's), and
                # below it that rank's traceback (where in torch it raised: the address a known root cause is met by)
                failures[r] = (type(f[0], (Exception,), {})(f"{f[1]}\n{f[2]}"), traceback.StackSummary())
        raise CheckpointException(f"pp checkpoint load failed on ranks {sorted(failures)}", failures) from error

def _cpu(v):
    if isinstance(v, dict):
        return {k: _cpu(t) for k, t in v.items()}
    return None if v is None else v.detach().cpu().clone()
