"""The parity oracle: a sharded run's loss, forward/backward output, grads,
params or optimizer state differ from the unsharded reference's, beyond the
derived tolerance (a silent bug)."""
from __future__ import annotations

import re

from . import Oracle
from .common import bound_words, num
from .source import frame_source, link


def signature(case, verdict: dict) -> str:
    first = verdict["first"]
    quantity = first["quantity"].replace("param_groups.", "group.")
    if quantity in ("forward", "backward"):  # localised: the module is the bug's address
        return f"{case.target}.parity.{quantity}.{first.get('module', 'unknown')}"
    if quantity in ("loss", "grad"):  # a forward/backward bug: the optimizer is irrelevant
        # a grad where the reference has none (or none where it has one) is its own kind of bug
        presence = f".{first['presence']}" if "presence" in first else ""
        return f"{case.target}.parity.{quantity}{presence}"
    # the implementation is half a step bug's address; a fused kernel's, also the layout of the grad it read
    layout = ".noncontig_grad" if first.get("grad") == "non-contiguous" else ""
    return f"{case.target}.parity.{case.optim.name}.{case.optim.implementation}.{quantity}{layout}"


def summary(verdict: dict) -> str:
    m = verdict["first"]
    if m["quantity"] in ("forward", "backward"):
        where = f"{m['quantity']} of step {m['step']}"
    elif m["step"] >= 0:
        where = f"{m['quantity']} of {m['fqn'] or 'the model'} after step {m['step']}"
    else:
        where = f"{m['quantity']} of {m['fqn']} after the constructor"
    extra = f" (max abs err {m['max_abs']:.3g}, {m['bad']}/{m['numel']} elements; tolerance: {m['tolerance']})" if "max_abs" in m else ""
    return f"parity: {where} differs: {m['detail']}{extra}; {verdict['count']} mismatches in all"


def address(case, verdict: dict) -> str:
    """The module of a localized divergence; for a step divergence, the code that stepped."""
    first = verdict.get("first") or {}
    quantity = first.get("quantity", "")
    if quantity in ("forward", "backward"):
        return f"{quantity} of {first.get('module', '?')}"
    if quantity in ("loss", "grad"):
        return quantity + (f" {first['presence']}" if "presence" in first else "")
    kw = case.optim.kwargs  # a fused kernel is shared by its optimizers; elsewhere the optimizer is the code
    if kw.get("fused"):
        return "optimizer step: fused kernel" + (", non-contiguous grad" if first.get("grad") == "non-contiguous" else "")
    return f"optimizer step: {case.optim.name}"


def _thing(m: dict) -> str:
    """What a mismatch is of, as a torch user names it."""
    q, fqn = m.get("quantity", "?"), m.get("fqn") or ""
    if q in ("forward", "backward"):
        module = f" ({m['module']})" if m.get("module") else ""
        return f"{'output' if q == 'forward' else 'input grad'} of `{fqn}`{module}" if fqn else f"{q} of {m.get('module', '?')}"
    if q == "loss":
        return "loss"
    if q.startswith("param_groups."):
        return f"`{q.split('.', 1)[1]}` of {fqn or 'a param group'}"
    if q.startswith("state."):
        return f"optimizer state `{q.split('.', 1)[1]}` of `{fqn}`"
    return (f"param `{fqn}`" if q == "param" else f"{q} of `{fqn}`") if fqn else q


def title(case, verdict: dict) -> str:
    first = verdict.get("first") or {}
    impl = "fused" if case.optim.kwargs.get("fused") else "foreach" if case.optim.kwargs.get("foreach") else "for-loop"
    return (f"{_thing(first).replace('`', '')} differs from the unsharded model after step {first.get('step', 0)} "
            f"({case.optim.name}, {impl}, {case.world_size} ranks)")


def what(case, verdict: dict) -> str:
    """Silently wrong: what differs from the same model without sharding, in words any script showing it
    shares (the module type, the optimizer step; no tensor names or numbers of the fuzzed case)."""
    first = verdict.get("first") or {}
    q = first.get("quantity", "")
    if q in ("forward", "backward"):
        part = f"the {'output' if q == 'forward' else 'input grad'} of a sharded `{first.get('module', 'module')}`"
        return f"No error is raised, but {part} differs from the same module's without sharding by more than rounding allows."
    if q == "loss":
        return "No error is raised, but the loss of the sharded model differs from the same model's without sharding."
    if q == "grad":
        if first.get("presence") == "appeared":
            return ("No error is raised, but a param of the sharded model gets a grad where the same model without "
                    "sharding gives it none (`.grad` is None there).")
        if first.get("presence"):
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


def expected(case, verdict: dict) -> str:
    dtype = case.dtype if case is not None else "floating-point"
    return f"the sharded model trains like the same model without sharding, up to {dtype} rounding"


def expected_actual(verdict: dict) -> list[str]:
    """The recorded run's first differences, numbers against the rounding they exceed."""
    mismatches = verdict.get("mismatches", [])[:6]
    rows = ["**Expected**: the sharded model matches the same model trained without sharding up to rounding; "
            "**actual** (the first differences):", "",
            "| what | step | without sharding (expected) | sharded (actual) | max abs err | rounding allows | elements off |",
            "|---|---|---|---|---|---|---|"]
    for m in mismatches:
        if "max_abs" in m:
            want, got, err = num(m.get("want")), num(m.get("got")), num(m.get("max_abs"))
            allowed, off = num(m.get("allowed")), f"{m.get('bad', '?')}/{m.get('numel', '?')}"
        else:  # a grad on one side only, a hyperparameter: the detail says it
            want, got = _sides(m.get("detail", ""))
            err = allowed = off = ""
        rows.append(f"| {_thing(m)} | {m.get('step')} | {want} | {got} | {err} | {allowed} | {off} |")
    first = next((m for m in mismatches if "max_abs" in m), None)
    if first:
        rows += ["", f"The {_thing(first)} differs by more than {bound_words(first.get('tolerance', ''))} allows: "
                     f"{first['max_abs']:.2g} vs at most {first['allowed']:.2g}."]
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


def source(case, verdict: dict) -> str:
    """A traceback's frame if the verdict has one; else, for a param or state divergence, the step
    implementation the case ran (a guess, and said to be one)."""
    made = frame_source(verdict)
    if made:
        return made
    if (verdict.get("first") or {}).get("quantity") in ("param", "state"):
        impl = {"fused": "_fused", "foreach": "_multi_tensor", "forloop": "_single_tensor"}[case.optim.implementation]
        module = case.optim.name.lower()
        return link(f"torch/optim/{module}.py:{impl}_{module}") + " (a guess: the step implementation that ran)"
    return ""


ORACLE = Oracle("parity", "silent", signature, summary, address, title, expected_actual, source, what, expected)
