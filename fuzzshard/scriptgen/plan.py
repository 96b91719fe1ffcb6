"""What a case's script runs and checks (its plan, from the verdict's oracle), or why it cannot be written.

``plan_of(case, verdict)``: the mode (an error's run, a checkpoint's round trip, parity, a replica, or all of it
for a case), the steps and sides it runs; a silent finding's plan is its oracle's ``script`` (oracle/NAME.py).
``fallback_reason``: why no straight-line script can be written (the target's writer refuses an option, a
plugin's file was not recorded, the oracle's check is not written, ...): the flattened kernel is then the repro.
"""
from __future__ import annotations

import re

import torch

from ..case import Case
from .. import targets
from ..kernel import dropout
from ..kernel.model import BUILTIN_MODELS, USER_MODELS
from . import common, loop
from .checks import step_tolerance
from .registry import writer
from .. import oracle as oracles  # what a finding of each oracle is
from ..verdict import Verdict


def fallback_reason(case: Case, environment: dict | None = None, verdict: Verdict | None = None) -> str | None:
    """Why the straight-line script cannot be written (the flattened kernel is then the repro); None: it can."""
    w = writer(case.target)
    if w is None:
        return f"no straight-line writer for the target {case.target}"
    why = _unsupported(case, w, environment or {})
    if why:
        return why
    plan = plan_of(case, verdict)
    if isinstance(plan, str):  # (plan_of writes errors, checkpoint round trips, replicas, and parity after a load)
        return plan
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    if plan["mode"] != "error" and case.model.factory == "decoder" and any(o.get("tp") for o in sides):
        # (written for an error's run: a clean case's grads under it differ from the plain replay's by ~0.2%
        # where the kernel's run passes, not yet understood)
        return "TP of the decoder transformer (torchtitan's plan) outside an error's run"
    if plan["mode"] == "replica":
        q = plan["quantity"]
        if q.split(".")[0] not in getattr(w, "REPLICAS", ("grad", "param", "state", "param_groups", "clip_norm", "loop")):
            return f"{case.target}'s replicas of {q} are not observable"
        if q == "grad" and w.grads(case, case.target_options) is None:
            return f"{case.target}'s grads are not observable under these options"
    checked = case.checkpoint.target_options if plan.get("resumed") else case.target_options  # (the side checked)
    if plan["mode"] in ("parity", "checkpoint", "replica") and w.snapshot(case, checked) is None:
        return f"{case.target}'s full state is not observable under these options"
    if plan["mode"] in ("parity", "all") and dropout.mode(case) == "replay" and (
            case.target_options.get("mp") or case.dtype in ("bfloat16", "float16")):
        return "dropout's replay under mixed precision or a low-precision sensitivity probe"
    if dropout.mode(case) == "replay" and case.checkpoint:
        t, ck = targets.get(case.target), case.checkpoint
        if (t.dropout_world(case.target_options, case.world_size), t.microbatches(case.target_options)) != \
                (t.dropout_world(ck.target_options, ck.world_size), t.microbatches(ck.target_options)):
            return "dropout's replay over another data-parallel split after the load"
    if plan["mode"] != "parity":
        return None
    if w.grads(case, checked) is None:
        return f"{case.target}'s grads are not observable under these options"
    if case.target_options.get("mp") and (case.target_options.get("tp") or case.target_options.get("nonroot")):
        return "parity under mixed precision with TP or a non-root forward"
    if plan["what"] in ("", "param", "state") and "update_rel" in step_tolerance(case):
        return "parity of a compiled optimizer step (its allowance is the kernel's, per element)"
    return None


def _unsupported(case: Case, w, env: dict) -> str | None:
    plugins = env.get("plugins") or []
    if case.model.factory and case.model.factory not in BUILTIN_MODELS and not plugins:
        return f"the plugin model {case.model.factory!r}, its file not recorded in the finding"
    if case.model.factory and case.model.factory not in BUILTIN_MODELS | USER_MODELS.keys():
        return f"the plugin model {case.model.factory!r}, not loaded here (--plugin its file)"  # (its shapes: built on meta)
    if not hasattr(torch.optim, case.optim.name) and not plugins:
        return f"the plugin optimizer {case.optim.name!r}, its file not recorded in the finding"
    if len(plugins) > 1:
        return f"{len(plugins)} plugin files"
    if not common.literal_ok(case.optim.kwargs) or not all(common.literal_ok(g.overrides) for g in case.groups):
        return "hyperparameters that are not Python literals"
    if any(layer.kind == "act" and layer.act not in common.ACTS for layer in common.walk(case.model.layers)):
        return "an activation the script does not write"
    moes = [layer.moe for layer in common.walk(case.model.layers) if layer.kind == "moe"]
    if case.model.factory == "decoder" and case.model.sizes.get("moe"):
        return "the decoder transformer with MoE blocks"
    if moes and not getattr(w, "MOE", False):
        return f"an MoE layer under {case.target} (its writer does not write one)"
    unwritten = sorted({k for cfg in moes for k in cfg} - common.MOE_WRITTEN)
    if unwritten:
        return f"an MoE with {', '.join(unwritten)} (the script's MoE is dropless, without aux loss or routing bias)"
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    for o in sides:
        why = w.unsupported(case, {k: v for k, v in o.items() if k not in ("ac", "ac_how", "ac_wrapper")}) or \
            common.ac_unsupported(case, o, w)  # activation checkpointing: common.ac_lines, every writer's
        if why:
            return f"{case.target} {why}"
        if o.get("tp") and case.model.factory and not (case.model.factory == "decoder" and getattr(w, "DECODER_TP", False)):
            return "TP of the decoder transformer (torchtitan's plan)" if case.model.factory == "decoder" else \
                f"TP of the plugin model {case.model.factory!r}"
    if case.checkpoint and case.checkpoint.kind not in w.KINDS:
        return f"the checkpoint kind {case.checkpoint.kind}"
    return loop.unsupported(case)  # the training loop around the step (scaler, clip, LR scheduler)


def plan_of(case: Case, verdict: Verdict | None) -> dict | str:
    """What the script runs and checks (or why it cannot: a string): mode (error, checkpoint, parity, replica,
    all), the last saving-side step, whether the loading side runs and its last step,
    whether each step observes the full state (where the kernel's gathers raised). An error's (a crash's, a
    hang's) here; a silent finding's is its oracle's ``script`` (oracle/NAME.py), these defaults updated."""
    ck, n = case.checkpoint, len(case.schedule)
    oracle, first = (verdict.oracle or "", verdict.first) if verdict else ("", None)
    save_last = ck.after if ck else n - 1
    plan = {"mode": "all", "last": save_last, "load": bool(ck), "load_last": n - 1, "observe": False, "check": "",
            "ckpt": bool(ck)}  # ckpt: whether the script saves (and loads)
    if verdict and (oracles.raised(verdict) or oracles.costly(verdict) or verdict.error and not first):
        # an error, a crash or a hang: the run up to where it raised or stopped (where the ranks did not finish,
        # observing the full state after each step as the kernel's gathers do)
        err = verdict.error_record
        phase = err.phase or ""
        plan.update(mode="error", observe=oracles.costly(verdict) or "gather" in phase, check=err.type)
        m = re.match(r"step (\d+)", phase)
        if m:
            k = int(m.group(1))
            if ck and k > ck.after:
                plan["load_last"] = k
            else:
                plan.update(last=k, load=False)
        elif phase in ("shard", "optimizer constructor", "gather initial optimizer state"):
            plan.update(last=-1, load=False)
        elif phase == "checkpoint save":
            plan["load"] = False
        elif phase.startswith("checkpoint load") or phase == "checkpoint barrier":
            plan["load_last"] = ck.after if ck else n - 1
        return plan
    # a silent finding: the script writes out its oracle's own comparison (its ``script``: docs/extending.md, An oracle)
    o = oracles.checks(case, verdict)
    if o.script is None:
        return f"a finding of the {oracle} oracle, whose check the script does not write"
    return o.script(case, verdict, plan)
