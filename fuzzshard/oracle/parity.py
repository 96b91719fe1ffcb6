"""The parity oracle: a sharded run's loss, forward/backward output, grads,
params or optimizer state differ from the unsharded reference's, beyond the
derived tolerance (a silent bug)."""
from __future__ import annotations

import re

from . import Oracle
from .common import bound_words, num
from .source import frame_source, link
from ..verdict import Mismatch, Verdict


def signature(case, verdict: Verdict) -> str:
    first = verdict.first
    quantity = first.quantity.replace("param_groups.", "group.")
    if quantity in ("forward", "backward"):  # localised: the module is the bug's address
        return f"{case.target}.parity.{quantity}.{first.extra.get('module', 'unknown')}"
    if quantity in ("loss", "grad"):  # a forward/backward bug: the optimizer is irrelevant
        # a grad where the reference has none (or none where it has one) is its own kind of bug
        presence = f".{first.extra['presence']}" if "presence" in first.extra else ""
        return f"{case.target}.parity.{quantity}{presence}"
    if _loop(quantity):  # the training loop's (kernel/loop.py): the clip, the scaler, the scheduler, not the optimizer
        return f"{case.target}.parity.{quantity}"
    # the implementation is half a step bug's address; a fused kernel's, also the layout of the grad it read
    layout = ".noncontig_grad" if first.extra.get("grad") == "non-contiguous" else ""
    return f"{case.target}.parity.{case.optim.name}.{case.optim.implementation}.{quantity}{layout}"


def summary(verdict: Verdict) -> str:
    m = verdict.first
    if m.quantity in ("forward", "backward"):
        where = f"{m.quantity} of step {m.step}"
    elif m.step >= 0:
        where = f"{m.quantity} of {m.fqn or 'the model'} after step {m.step}"
    else:
        where = f"{m.quantity} of {m.fqn} after the constructor"
    x = m.extra
    extra = f" (max abs err {x['max_abs']:.3g}, {x['bad']}/{x['numel']} elements; tolerance: {x['tolerance']})" if "max_abs" in x else ""
    return f"parity: {where} differs: {m.detail}{extra}; {verdict.extra['count']} mismatches in all"


def address(case, verdict: Verdict) -> str:
    """The module of a localized divergence, forward or backward alike (the
    module whose forward or backward made it: kernel/localize.py); for a step
    divergence, the code that stepped."""
    quantity, x = verdict.quantity, verdict.first.extra if verdict.first else {}
    if quantity in ("forward", "backward"):
        return f"forward/backward of {x.get('module', '?')}"
    if quantity in ("loss", "grad"):
        return quantity + (f" {x['presence']}" if "presence" in x else "")
    if _loop(quantity):
        return {"clipped_grad": "grad clipping", "clip_norm": "grad clipping: total norm",
                "loop.scale": "grad scaler", "loop.last_lr": "LR scheduler"}.get(quantity, quantity)
    if quantity.startswith("param_groups."):  # a hyperparameter: set by what owns the groups, not by the step's code
        return "param group " + quantity.split(".", 1)[1]
    kw = case.optim.kwargs  # a fused kernel is shared by its optimizers; elsewhere the optimizer is the code
    if kw.get("fused"):  # a grad scaler hands a fused kernel its found_inf: a code path of its own
        return ("optimizer step: fused kernel" + (", non-contiguous grad" if x.get("grad") == "non-contiguous" else "")
                + (", under a grad scaler" if case.scaler else ""))
    return f"optimizer step: {case.optim.name}"


def _loop(quantity: str) -> bool:
    """A quantity of the training loop around the step (kernel/reference.py's _loop_step, _compare_loop)."""
    return quantity in ("clipped_grad", "clip_norm") or quantity.startswith("loop.")


def _thing(m: Mismatch | None) -> str:
    """What a mismatch is of, as a torch user names it."""
    if m is None:
        return "?"
    q, fqn, module = m.quantity, m.fqn or "", m.extra.get("module")
    if q in ("forward", "backward"):
        return f"{'output' if q == 'forward' else 'input grad'} of `{fqn}`" + (f" ({module})" if module else "") \
            if fqn else f"{q} of {module or '?'}"
    if q == "loss":
        return "loss"
    if q.startswith("param_groups."):
        return f"`{q.split('.', 1)[1]}` of {fqn or 'a param group'}"
    if q.startswith("state."):
        return f"optimizer state `{q.split('.', 1)[1]}` of `{fqn}`"
    return (f"param `{fqn}`" if q == "param" else f"{q} of `{fqn}`") if fqn else q


def title(case, verdict: Verdict) -> str:
    first = verdict.first
    impl = "fused" if case.optim.kwargs.get("fused") else "foreach" if case.optim.kwargs.get("foreach") else "for-loop"
    return (f"{_thing(first).replace('`', '')} differs from the unsharded model after step {first.step if first else 0} "
            f"({case.optim.name}, {impl}, {case.world_size} ranks)")


def what(case, verdict: Verdict) -> str:
    """Silently wrong: what differs from the same model without sharding, in words any script showing it
    shares (the module type, the optimizer step; no tensor names or numbers of the fuzzed case)."""
    q, x = verdict.quantity, verdict.first.extra if verdict.first else {}
    if q in ("forward", "backward"):
        part = f"the {'output' if q == 'forward' else 'input grad'} of a sharded `{x.get('module', 'module')}`"
        return f"No error is raised, but {part} differs from the same module's without sharding by more than rounding allows."
    if q == "loss":
        return "No error is raised, but the loss of the sharded model differs from the same model's without sharding."
    if q == "grad":
        if x.get("presence") == "appeared":
            return ("No error is raised, but a param of the sharded model gets a grad where the same model without "
                    "sharding gives it none (`.grad` is None there).")
        if x.get("presence"):
            return ("No error is raised, but a param of the sharded model gets no grad where the same model without "
                    "sharding gives it one.")
        return "No error is raised, but the grads of the sharded model differ from the same model's without sharding."
    step = "the optimizer step"  # (a hand-reduced script may show it with another optimizer the bug shares)
    if q.startswith("param_groups."):
        return (f"No error is raised, but after {step} the param group's `{q.split('.', 1)[1]}` differs from the same "
                f"optimizer's without sharding.")
    part = "the optimizer state" if q.startswith("state.") else "the params"
    return (f"No error is raised, but after {step} {part} of the sharded model differ from those of the same model "
            f"trained without sharding by more than rounding allows.")


def expected(case, verdict: Verdict) -> str:
    dtype = case.dtype if case is not None else "floating-point"
    return f"the sharded model trains like the same model without sharding, up to {dtype} rounding"


def expected_actual(verdict: Verdict) -> list[str]:
    """The recorded run's first differences, numbers against the rounding they exceed."""
    mismatches = (verdict.mismatches or [])[:6]
    rows = ["**Expected**: the sharded model matches the same model trained without sharding up to rounding; "
            "**actual** (the first differences):", "",
            "| what | step | without sharding (expected) | sharded (actual) | max abs err | rounding allows | elements off |",
            "|---|---|---|---|---|---|---|"]
    for m in mismatches:
        x = m.extra
        if "max_abs" in x:
            want, got, err = num(x.get("want")), num(x.get("got")), num(x.get("max_abs"))
            allowed, off = num(x.get("allowed")), f"{x.get('bad', '?')}/{x.get('numel', '?')}"
        else:  # a grad on one side only, a hyperparameter: the detail says it
            want, got = _sides(m.detail)
            err = allowed = off = ""
        rows.append(f"| {_thing(m)} | {m.step} | {want} | {got} | {err} | {allowed} | {off} |")
    first = next((m for m in mismatches if "max_abs" in m.extra), None)
    if first:
        rows += ["", f"The {_thing(first)} differs by more than {bound_words(first.extra.get('tolerance', ''))} allows: "
                     f"{first.extra['max_abs']:.2g} vs at most {first.extra['allowed']:.2g}."]
    return rows + [""]


def _sides(detail: str) -> tuple[str, str]:
    """(unsharded, sharded) of a detail that says them in words."""
    m = re.match(r"sharded has (.*), reference has (.*)$", detail)
    if m:
        return m.group(2), m.group(1)
    m = re.match(r"(.*) vs reference (.*)$", detail)
    if m:
        return m.group(2), m.group(1)
    return "", detail.replace("reference", "unsharded")


def source(case, verdict: Verdict) -> str:
    """A traceback's frame if the verdict has one; else, for a param or state divergence, the step
    implementation the case ran (a guess, and said to be one)."""
    made = frame_source(verdict)
    if made:
        return made
    if verdict.quantity in ("param", "state"):
        impl = {"fused": "_fused", "foreach": "_multi_tensor", "forloop": "_single_tensor"}[case.optim.implementation]
        module = case.optim.name.lower()
        return link(f"torch/optim/{module}.py:{impl}_{module}") + " (a guess: the step implementation that ran)"
    return ""


def script(case, verdict: Verdict | None, plan: dict) -> dict | str:
    """A straight-line script's plan (fuzzshard/scriptgen): a plain copy of the model replays the step that
    diverged (every step, without a verdict), anchored on the sharded run's state, and compares what the
    first mismatch is of ("what": the grads, the step's params, state or groups, the clip, the loop)."""
    ck, n = case.checkpoint, len(case.schedule)
    first = verdict.first if verdict else None
    stateful = bool(case.lr_scheduler or case.scaler)  # the loop carries state from step to step (scriptgen/loop.py)
    k = first.step if first else n - 1
    resumed = bool(ck and k > ck.after)  # the steps checked run on the loading side, after the load
    if resumed and (ck.world_size < case.ranks or stateful or not first):
        return "a parity finding after a checkpoint load" + \
            (" on fewer ranks than the script's" if ck.world_size < case.ranks else
             " with the loop's state (the scheduler's, the scaler's)" if stateful else "")
    q = first.quantity if first else ""  # what the replay compares: the grads (the forward) or what the step made
    what = "" if not first else "grad" if q in ("grad", "loss", "forward") else "param" if q == "param" else \
        "state" if q.startswith("state") else "group" if q.startswith("param_groups") else \
        "clip" if q in ("clip_norm", "clipped_grad") else "loop" if q.startswith("loop.") else ""
    if first and stateful and what not in ("grad", "clip"):
        first = None  # the scheduler and the scaler carry state from step to step: each step replayed
    plan.update(mode="parity", last=k, load=False, ckpt=False, steps=[k] if first else list(range(k + 1)), what=what)
    if resumed:  # the saving side up to its save, the loading side from the load to step k, checked there
        plan.update(last=ck.after, load=True, load_last=k, ckpt=True, resumed=True)
    return plan


ORACLE = Oracle("parity", "silent", signature, summary, address, title, expected_actual, source, what, expected,
                phase=lambda q: q if q in ("loss", "grad", "forward", "backward") else "loop" if _loop(q) else "step",
                localize=lambda v: v.quantity in ("loss", "grad"),  # a module's output or grad names it then
                localized=lambda v: v.quantity in ("forward", "backward"), script=script)
