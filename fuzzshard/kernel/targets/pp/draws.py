"""What a pp case may be: its draws, its check, its fit to another world size.

The target options drawn (``draw_options``: the schedule, stages per rank,
cuts, scale_grads, FSDP2's on a [pp, dp] mesh; ``draw_late_options_both_sides``:
the microbatch count and ``accum`` once the batch is known, for a
checkpoint's loading side too), the check that refuses an impossible case
(``check``, ``check_checkpoint``), and the fit to another world size
(``fit_options``). The target's Spec hands them to the strategies, the Case
checks and the shrinker.
"""
from __future__ import annotations

import dataclasses
import math

from ....case import Case
from ...dropout import has_dropout
from ...model import tie_uses
from ...moe import moe_configs_of
from .checkpoint import CHECKPOINT_KINDS
from .schedules import (SCHEDULES, accepts, available, schedule_dropout_problem, is_multi, n_stages, n_units, pp_degree,
                        stage_layers, stage_ranks, stages_per_rank, tie_span, uncuttable)


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """A schedule the installed torch has that the model's top-level layers
    (the decoder's blocks) can fill (one or more per stage), its stages per
    rank, the cut points, scale_grads. A model with fewer of them than ranks
    (or a plugin's model, a tied head) cannot be cut: rejected. On a
    2-D mesh [pp, dp], FSDP2 on each stage: ``dp``, ``reshard_after_forward``,
    the top-level layers with their own fully_shard (``wrap``), and where the
    model's MoE experts divide over dp, expert parallelism over dp (``ep``); drawn
    after the rest, and only there, so the 1-D draws stay as they were."""
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
    # a case a timed session aimed at ``ep`` (``aim``: the Spec's corner) most often with scale_grads: the schedule's
    # divide of the grads the experts, outside FSDP2, get too (off first, as every aimed draw)
    scale = st.sampled_from([False, True, True, True]) if context.get("aim") else st.booleans()
    out = {"schedule": schedule, "cuts": cuts, "scale_grads": draw(scale)}
    if stages > 1:
        out["stages"] = stages
    if len(mesh_shape) == 2:
        out["dp"] = mesh_shape[1]
        out["reshard_after_forward"] = draw(st.booleans())  # torchtitan's default under PP: False
        wrap = [f"layers.{i}" for i in range(n) if draw(st.booleans())]
        if wrap:
            out["wrap"] = wrap
        # drawn last, off first, only where the model's MoE experts divide over dp (else no draw: such cases stay
        # as they were): expert parallelism over the dp dim (``ep``)
        # (not on a checkpoint's loading side, and dropped late on a saving side: pp's ep takes no checkpoint yet);
        # on, undrawn, in a case a timed session aimed at it (``aim``: the Spec's steered corner; strategies.cases)
        if not context.get("loading") and ep_fits(model, mesh_shape[1]) and (context.get("aim") or draw(st.booleans())):
            out["ep"] = True
    return out


def ep_fits(model, dp: int) -> bool:
    """Whether ``ep`` may be drawn: the model has MoE layers and their experts divide over ``dp``."""
    cfgs = moe_configs_of(model)
    return bool(cfgs) and all(c.get("experts", 2) % dp == 0 for c in cfgs)


def ep_problem(case: Case) -> str | None:
    """``ep``'s rules: FSDP2's 2-D mesh (the experts shard over its dp dim), MoE layers whose experts divide over
    dp (torchtitan's num_experts % ep == 0)."""
    o = case.target_options
    if not o.get("ep"):
        return None
    if o["ep"] is not True:
        return f"pp: ep is True or absent, not {o['ep']!r}"
    if not o.get("dp"):
        return "pp: ep shards the experts over the dp dim of a 2-D mesh [pp, dp]"
    if not moe_configs_of(case.model):
        return "pp: ep shards an MoE's experts: the model has no MoE layer"
    bad = [c.get("experts", 2) for c in moe_configs_of(case.model) if c.get("experts", 2) % o["dp"]]
    if bad:
        return f"pp: {bad[0]} experts do not divide over the EP degree (dp) {o['dp']}"
    if o.get("ac"):
        return ("pp: ep with activation checkpointing (the recomputation reruns the experts' all-to-alls inside "
                "the stage's backward): not composed yet")
    return None


def draw_late_options(draw, case: Case, aim: bool = False) -> dict:
    """``n_microbatches``, once the batch is known: three times in four a
    divisor of the batch (each dp rank's slice of it on a [pp, dp] mesh, which
    must divide it) that the schedule takes (equal microbatches; any
    divisor where none is taken), else any count up to one past the batch
    (unequal microbatches, which torch's split makes; fewer than 1F1B's
    stages, or one past the batch: torch refuses them, an invalid case).
    Then ``accum``, where the slice splits into that many equal parts of
    ``n_microbatches`` samples or more (drawn last: the draws before stay).
    ``aim``: a case a timed session aimed at ``ep`` (the Spec's corner) takes 2+ microbatches most often, where the
    schedule takes them (the experts' all-to-alls per microbatch, their grads summed over them outside FSDP2); off
    first."""
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
        several = [d for d in taken if d > 1]
        if aim and several and draw(st.sampled_from([False, True, True, True])):
            opts["n_microbatches"] = draw(st.sampled_from(several))
        elif draw(st.integers(0, 3)):
            opts["n_microbatches"] = draw(st.sampled_from(taken or divisors))
        else:
            opts["n_microbatches"] = draw(st.integers(1, batch + 1))
        accums = [a for a in (1, 2, 3) if batch % a == 0 and batch // a >= opts["n_microbatches"]]
        if len(accums) > 1:
            accum = draw(st.sampled_from(accums))
            if accum > 1:
                opts["accum"] = accum
    return opts


def draw_late_options_both_sides(draw, case: Case, aim: bool = False) -> dict:
    """``draw_late_options`` for the case, and for a checkpoint's loading side its own microbatch count (its own
    schedule at its own world size): one the schedule takes, a divisor of the batch where one is taken, else
    any count up to the batch it takes (unequal microbatches), else a divisor (refused: an invalid case). The
    saving side's draw explores torch's refusals; the loading side's would only double them. The count is
    written into the checkpoint's target options (a dict drawn for this case alone; the late draw returns the
    saving side's). A checkpoint where a side's rank would hold no state (``stateless_ranks``) is rejected."""
    import hypothesis.strategies as st
    from hypothesis import assume

    out = draw_late_options(draw, case, aim)
    ck = case.checkpoint
    if ck is not None:
        out.pop("ep", None)  # not with a checkpoint yet (check)
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
    if ep_problem(case):
        return ep_problem(case)
    if not dp and any(k in o for k in ("wrap", "reshard_after_forward")):
        return "pp: wrap and reshard_after_forward are FSDP2's, on a 2-D mesh [pp, dp]"
    if dp and case.batch % dp:
        return f"pp: each of the {dp} dp ranks trains on an equal slice of the batch ({case.batch})"
    accum = o.get("accum", 1)
    if type(accum) is not int or accum < 1 or (case.batch // (dp or 1)) % accum:
        return f"pp: accum {accum} must be a positive int dividing each dp rank's slice of the batch"
    if case.checkpoint and (o.get("ep") or case.checkpoint.target_options.get("ep")):
        return "pp: ep with a checkpoint (the experts' DTensor shards over dp through DCP): not composed yet"
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
    if has_dropout(case.model) and schedule_dropout_problem(o):  # (kernel/dropout.py: which schedules' masks are replayed)
        return schedule_dropout_problem(o)
    if dp and tie_span(case) == "stages":
        return ("pp: a tied weight on two stages of one rank under FSDP2: each stage module is a fully_shard root of "
                "its own, and FSDP2 keeps a shared param in one group only (fully_shard([a, b]))")
    return None


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


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """Another world size: the first cuts, as many as its stages need (the check refuses too few); ``dp``
    the mesh's second dim (FSDP2's options and ``ep`` dropped on a 1-D mesh; experts that no longer divide over
    the new dp: the check refuses)."""
    if len(mesh_shape) == 2:
        options["dp"] = mesh_shape[1]
        options.setdefault("reshard_after_forward", False)
    else:
        for key in ("dp", "wrap", "reshard_after_forward", "ep"):
            options.pop(key, None)
    if "cuts" in options:
        options["cuts"] = options["cuts"][:n_stages(options, math.prod(mesh_shape)) - 1]
    return options
