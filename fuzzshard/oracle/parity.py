"""The parity oracle: a sharded run's loss, forward/backward output, grads,
params or optimizer state differ from the unsharded reference's, beyond the
derived tolerance (a silent bug)."""
from __future__ import annotations

from . import Oracle
from .common import num
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


def title(case, verdict: dict) -> str:
    first = verdict.get("first") or {}
    impl = "fused" if case.optim.kwargs.get("fused") else "foreach" if case.optim.kwargs.get("foreach") else "for-loop"
    what = (f"{first.get('quantity')} of {first['module']}" if first.get("module")
            else f"{first.get('quantity', '?')} {first.get('fqn', '')}".rstrip())
    return (f"{what} differs from the unsharded model after step {first.get('step', 0)} "
            f"({case.optim.name}, {impl}, world size {case.world_size})")


def expected_actual(verdict: dict) -> list[str]:
    """The first mismatches as a table, numbers against the bound they broke."""
    rows = ["**Expected**: the sharded run matches the unsharded reference within the derived bound; "
            "**actual** (first mismatches, sharded vs unsharded):", "",
            "| quantity | tensor | step | expected (unsharded) | actual (sharded) | max abs err | allowed | bad |",
            "|---|---|---|---|---|---|---|---|"]
    for m in verdict.get("mismatches", [])[:6]:
        rows.append(f"| {m.get('quantity')} | {m.get('module') or m.get('fqn') or '(loss)'} | {m.get('step')} "
                    f"| {num(m.get('want'))} | {num(m.get('got'))} | {num(m.get('max_abs'))} "
                    f"| {num(m.get('allowed'))} | {m.get('bad', '?')}/{m.get('numel', '?')} |")
    tol = (verdict.get("first") or {}).get("tolerance")
    return rows + ([f"", f"The bound: {tol} (derived from the dtype and the reduction length, not tuned)."]
                   if tol else []) + [""]


def source(case, verdict: dict) -> str:
    """A traceback's frame if the verdict has one; else, for a param or state divergence, the step
    implementation the case ran (a guess, and said to be one)."""
    made = frame_source(verdict)
    if made:
        return made
    if (verdict.get("first") or {}).get("quantity") in ("param", "state"):
        impl = {"fused": "_fused", "foreach": "_multi_tensor", "forloop": "_single_tensor"}[case.optim.implementation]
        module = case.optim.name.lower()
        return link(f"torch/optim/{module}.py:{impl}_{module}") + " (a guess: the step implementation the case ran)"
    return ""


ORACLE = Oracle("parity", "silent", signature, summary, address, title, expected_actual, source)
