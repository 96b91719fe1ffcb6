"""What a pp case is beyond its fields: facts, coverage, where a tie runs.

``facts`` for a known finding's ``only_when`` (unequal microbatches, a
split-backward schedule meeting a stage with no path to its weights, a tie
scaled once per stage), over the steps after a checkpoint's load too
(``facts_with_checkpoint``); the session's ``coverage`` rows; where a tie
runs (``pp_tie``). The target's Spec hands them to the findings, the session
and ``show``.
"""
from __future__ import annotations

import dataclasses

from ....case import Case
from ...model import param_shapes, tie_uses
from .schedules import SPLIT_BACKWARD, n_stages, pp_degree, tie_span, uncuttable


def facts(case: Case) -> dict:
    """What a pp case is beyond its fields, for a known finding's ``only_when``: whether its microbatches are
    unequal, whether a split-backward schedule meets a stage whose input needs no grad (no trainable param
    before it), or FSDP2 stages resharded after forward."""
    o = case.target_options
    n_mb = o.get("n_microbatches") or 0
    out = {"schedule": o.get("schedule"), "n_stages": n_stages(o, case.world_size),
           "n_microbatches": n_mb, "scale_grads": o.get("scale_grads"),
           "uneven_microbatches": bool(n_mb) and (case.batch // o.get("dp", 1) // o.get("accum", 1)) % n_mb != 0,
           "dp": o.get("dp", 1), "accum": o.get("accum", 1), "ep": bool(o.get("ep")),
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


def pp_tie(case: Case) -> str:
    """Where the tie's two uses run (tie_span)."""
    if not tie_uses(case.model):
        return ""
    return {"": "one stage", "ranks": "across ranks, grad all-reduced",
            "stages": "two stages of one rank"}[tie_span(case)]


def coverage(case: Case) -> dict:
    o = case.target_options
    fsdp = f" FSDP2 [{pp_degree(o, case.world_size)},{o['dp']}]" if o.get("dp") else ""
    fsdp += " + EP over dp" if o.get("ep") else ""  # the stages' MoE experts sharded over dp (target.py)
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
