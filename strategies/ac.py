"""Activation checkpointing drawn on any target that takes it (its Spec's ``ac``; kernel/ac.py applies it):
which modules (each one or not, or every k-th top-level block as torchtitan's per-layer AC) and how.
Drawn last of all and only when a session asks (``cases(ac=True)``, ``fuzz --ac``): every draw before stays
as it was, and a shrunk case goes to no checkpointing."""
from __future__ import annotations

import dataclasses

import hypothesis.strategies as st

from fuzzshard.kernel import ac as kac
from fuzzshard.kernel.model import param_shapes


def ac_options(draw, spec, case, options: dict, forms=None) -> dict:
    """``options`` plus a drawn AC spec (one time in four, where the target takes AC), valid by construction.
    Where the target drew its modules itself (fsdp2's first spelling), only how is drawn. ``forms``: a timed
    session's weighted forms (session/schedule.py: the least drawn first), else each alike."""
    hows = [h for h in kac.AC_HOWS if h in spec.ac and not (spec.ac_rule and spec.ac_rule(options, h))]
    if not hows or not draw(st.sampled_from([False, False, False, True])):
        return options
    if options.get("ac"):  # the target drew its modules itself (fsdp2): only how, the non-reentrant forms
        how = draw(st.sampled_from([h for h in forms or hows if h in hows and h not in kac.AC_REENTRANT]
                                   or [h for h in hows if h not in kac.AC_REENTRANT]))
        out = {k: v for k, v in options.items() if k != "ac_wrapper"}
        return {**out, "ac_how": how} if how != "composable" else out
    how = draw(st.sampled_from([h for h in forms or hows if h in hows] or hows))
    shapes = param_shapes(case.model)
    if draw(st.booleans()):  # per layer: every k-th top-level block (torchtitan's ac_freq: blocks k-1, 2k-1, ...)
        k = draw(st.integers(1, 3))
        chosen = [b for i, b in enumerate(kac.ac_blocks(shapes)) if (i + 1) % k == 0]
    else:
        chosen = [m for m in kac.ac_candidates(shapes) if draw(st.booleans())]
    chosen = [m for m in chosen if kac.ac_moe_problem(case, spec, m) is None]  # an MoE run on full copies
    if how in kac.AC_REENTRANT:
        chosen = [m for m in chosen if kac.ac_reentrant_problem(case, m) is None]
    if not chosen:
        return options
    out = {**options, "ac": chosen}
    if how != "composable":  # the first spelling's default (kernel/ac.py: how)
        out["ac_how"] = how
    return out


def with_ac(draw, spec, case, forms=None):
    """``case`` with AC drawn on its side and on its checkpoint's loading side (each its own)."""
    if not spec.ac:
        return case
    case = dataclasses.replace(case, target_options=ac_options(draw, spec, case, case.target_options, forms))
    if case.checkpoint:
        ck = case.checkpoint
        case = dataclasses.replace(case, checkpoint=dataclasses.replace(
            ck, target_options=ac_options(draw, spec, case, ck.target_options, forms)))
    return case
