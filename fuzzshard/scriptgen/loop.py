"""The training loop around the step (kernel/loop.py) as a script writes it, in
torch's own words: the grad scaler (``scaler.scale(loss).backward()``, a loss
made infinite on purpose at the case's overflow steps, ``unscale_``,
``scaler.step`` / ``update``), the clip (``clip_grad_norm_``, torchtitan's
``get_total_norm`` + ``clip_grads_with_norm_`` with the norm made full, or
``clip_grad_value_``) and the LR scheduler (stepped after every step,
ReduceLROnPlateau fed the step's global loss), their state saved beside the
checkpoint (DCP or torch.save, as Loop.save / Loop.load) and, in a parity
replay, the plain model's own scaler, clip and scheduler run on the sharded
run's grads (as kernel/reference.py's _loop_step). Every function returns
lines (empty where the case draws none of it)."""
from __future__ import annotations

import re

from ..case import Case, LRScheduler
from .. import targets
from . import common
from .registry import writer

SCHED = "torch.optim.lr_scheduler."


def _writer(case: Case):
    return writer(case.target)


def _says(case: Case, what: str) -> bool:
    """What the target's writer module declares (``LOOP``: its scripts write the loop, the rest fall back to the
    flattened kernel; ``DTENSOR_GRADS``: its grads are DTensors, so a total norm over them is one, made full;
    ``SHARDED_SCALER``: its grad scaler is FSDP's ShardedGradScaler, unless the case draws amp's)."""
    return bool(getattr(_writer(case), what, False))


def used(case: Case) -> bool:
    return bool(case.clip or case.lr_scheduler or case.scaler)


def stateful(case: Case) -> bool:
    """Whether the loop has state a checkpoint keeps (the scheduler's, the scaler's)."""
    return bool(case.lr_scheduler or case.scaler)


def unsupported(case: Case) -> str | None:
    if not used(case):
        return None
    spec = targets.get(case.target).spec
    if case.clip and case.clip.how not in spec.clips or case.lr_scheduler and not spec.lr_scheduler or \
            case.scaler and not spec.scaler:
        return f"the training loop's {_names(case)} under {case.target}, which does not draw it"
    if not _says(case, "LOOP"):
        return f"the training loop's {_names(case)} under {case.target} (no straight-line writer for it yet)"
    if case.clip and case.clip.how == "own" and not _says(case, "OWN_CLIP"):
        return "the target's own clip_grad_norm_"
    o = case.target_options
    if plateau(case) and o.get("microbatches", 1) > 1:  # (fsdp2's gradient accumulation)
        return "ReduceLROnPlateau fed a loss accumulated over microbatches"
    if case.scaler and o.get("mp"):
        return "a grad scaler under mixed precision (the replay of FSDP2's casts does not scale its loss)"
    return None


def _names(case: Case) -> str:
    return " and ".join(n for n, on in (("clip", case.clip), ("LR scheduler", case.lr_scheduler),
                                        ("grad scaler", case.scaler)) if on)


def plateau(case: Case) -> bool:
    return bool(case.lr_scheduler) and case.lr_scheduler.name == "ReduceLROnPlateau"


def about(case: Case) -> str:
    """The loop in a few words, for the script's docstring."""
    parts = []
    if case.scaler:
        parts.append("a ShardedGradScaler" if _sharded_scaler(case) else "a GradScaler")
    if case.clip:
        parts.append({"norm": "clip_grad_norm_", "two_part": "get_total_norm + clip_grads_with_norm_",
                      "own": "the model's own clip_grad_norm_",
                      "value": "clip_grad_value_"}.get(case.clip.how, case.clip.how))
    if case.lr_scheduler:
        parts.append(case.lr_scheduler.name)
    return ", ".join(parts)


# ---- built beside the optimizer --------------------------------------------

def _scheduler(spec: LRScheduler, opt: str) -> str:
    kw = dict(spec.kwargs)
    if spec.name == "LambdaLR":  # the kernel's named lambdas (kernel/loop.py lr_lambda), written out
        if kw.pop("lambda", "linear_warmup") == "exponential":
            fn = f"lambda k: {kw.pop('factor', 0.9)!r} ** k"
        else:
            w = kw.pop("warmup", 2)
            fn = f"lambda k: (k + 1) / {w + 1} if k < {w} else 1.0"  # torchtitan's linear warmup
        kw.pop("factor", None), kw.pop("warmup", None)
        args = [fn]
    elif spec.name == "SequentialLR":
        args = ["[" + ", ".join(_scheduler(c, opt) for c in spec.children) + "]"]
    elif spec.name == "ChainedScheduler":
        return f"{SCHED}ChainedScheduler([" + ", ".join(_scheduler(c, opt) for c in spec.children) + f"], optimizer={opt})"
    else:
        args = []
    args += [f"{k}={common.lit(v)}" for k, v in kw.items()]
    return f"{SCHED}{spec.name}({', '.join([opt] + args)})"


def _sharded_scaler(case: Case) -> bool:
    """Whether the sharded run's scaler is FSDP's ShardedGradScaler (fsdp2's own; amp's where ``Scaler.amp``)."""
    return bool(case.scaler) and _says(case, "SHARDED_SCALER") and not getattr(case.scaler, "amp", False)


def imports(case: Case) -> list[str]:
    return ["from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler"] * _sharded_scaler(case) + \
        ["from torch.distributed.tensor import Replicate, distribute_tensor"] * bool(_partial(case))


def build(case: Case, opt: str = "opt", sched: str = "sched", scaler: str = "scaler", sharded: bool = True,
          shape: tuple = ()) -> list[str]:
    """The scheduler and the scaler over ``opt``: on fsdp2's sharded side FSDP's ShardedGradScaler (found_inf
    all-reduced) over every rank of the mesh, as the kernel's (never its default group, read at import)."""
    out = []
    if case.lr_scheduler:
        out.append(f"{sched} = {_scheduler(case.lr_scheduler, opt)}")
    if case.scaler:
        s = case.scaler
        kw = [f"init_scale={s.init_scale!r}"] + [f"{k}={getattr(s, k)!r}" for k, d in (
            ("growth_factor", 2.0), ("backoff_factor", 0.5), ("growth_interval", 2000)) if getattr(s, k) != d]
        if sharded and _sharded_scaler(case):  # (a writer's SCALER_GROUP: the group it names, as the kernel's)
            group = getattr(_writer(case), "SCALER_GROUP", "") or ("mesh.get_group()" if len(shape) == 1 else "dist.group.WORLD")
            out.append(f"{scaler} = ShardedGradScaler(device.type, process_group={group}, {', '.join(kw)})")
        else:
            out.append(f"{scaler} = torch.amp.GradScaler(device.type, {', '.join(kw)})")
    return out


# ---- each step of the sharded run ------------------------------------------

def backward(case: Case, lines: list[str], first: int, last: int) -> list[str]:
    """A target's forward/backward lines with the loss scaled: ``scaler.scale(loss).backward()``, times inf
    at the steps whose loss overflows on purpose."""
    if not case.scaler:
        return lines
    partial = _partial(case)
    over = [k for k in case.scaler.overflow if first <= k <= last and not (partial and partial.step == k)]
    if not over:
        inf, note = "", ""
    elif first == last:
        inf, note = " * float(\"inf\")", "  # the loss overflows on purpose: a step to skip"
    else:
        inf, note = f" * (float(\"inf\") if k in {over!r} else 1.0)", \
            f"  # step(s) {over}: the loss overflows on purpose (a step to skip)"
    out = []
    for ln in lines:
        m = re.fullmatch(r"(\s*)(.+?)\.backward\(\)(\s*#.*)?", ln)
        if m:
            loss = m.group(2)
            loss = loss[1:-1] if loss.startswith("(") and loss.endswith(")") else loss
            scaled = f"scaler.scale({loss})"
            ln = f"{m.group(1)}{f'({scaled}{inf})' if inf else scaled}.backward(){note or (m.group(3) or '')}"
        out.append(ln)
    return out


def _partial(case: Case, first: int = 0, last: int | None = None):
    at = case.scaler.overflow_at if case.scaler else None
    return at if at is not None and first <= at.step <= (len(case.schedule) - 1 if last is None else last) else None


def _value(at) -> str:
    return {"inf": "float(\"inf\")", "-inf": "-float(\"inf\")", "nan": "float(\"nan\")"}[at.value]


def _at_step(at, first: int, last: int, lines: list[str], why: str) -> list[str]:
    return [f"if k == {at.step}:  # {why}"] + common.indent(lines) if last > first else [f"# {why}"] + lines


def overflow(case: Case, first: int, last: int, model: str = "model") -> list[str]:
    """The sharded run's partial overflow (case.Overflow, kernel/loop.py inject_local), after backward and
    before ``unscale_``: the element set in this rank's local grad where its shard holds it (a DTensor grad's
    flat indices distributed as the grad is placed tell which), every copy of a replicated one."""
    at = _partial(case, first, last)
    if at is None:
        return []
    what = f"every element of {at.param}'s grad" if at.layer else f"element {at.index} of {at.param}'s grad"
    if at.layer:
        lines = [f"g = {model}.get_parameter({at.param!r}).grad",
                 "if g is not None:",
                 f"    (g.to_local() if isinstance(g, DTensor) else g).fill_({_value(at)})  # this rank's part of it"]
    else:
        lines = [f"g = {model}.get_parameter({at.param!r}).grad",
                 "if isinstance(g, DTensor):  # each element's flat index, placed as the grad: which this rank holds",
                 "    ids = torch.arange(g.numel(), device=g.to_local().device).reshape(g.shape)",
                 "    ids = distribute_tensor(ids, g.device_mesh, [Replicate() if q.is_partial() else q for q in g.placements])",
                 f"    g.to_local().masked_fill_(ids.to_local().to(g.to_local().device) == {at.index}, {_value(at)})",
                 "elif g is not None:",
                 f"    g.view(-1)[{at.index}] = {_value(at)}"]
    return _at_step(at, first, last, lines, f"{what} overflows on the ranks that hold it: every rank must skip")


def overflow_plain(case: Case, steps: list[int], model: str = "plain") -> list[str]:
    """The same partial overflow in the plain model's full grad (kernel/reference.py): its skip is the truth."""
    at = _partial(case)
    if at is None or at.step not in steps:
        return []
    g = f"{model}.get_parameter({at.param!r}).grad"
    set_ = f"{g}.fill_({_value(at)})" if at.layer else f"{g}.view(-1)[{at.index}] = {_value(at)}"
    lines = [f"if {g} is not None:", f"    {set_}  # the same non-finite value in the same element"]
    return _at_step(at, min(steps), max(steps), lines, "the partial overflow, in the full grad")


def unscale(case: Case, opt: str = "opt", scaler: str = "scaler", first: int = 0, last: int = -1) -> list[str]:
    if not case.scaler:
        return []
    return overflow(case, first, last) + [f"{scaler}.unscale_({opt})  # the grads as the plain model's"]


def _norm_type(case: Case) -> str:
    return "float(\"inf\")" if case.clip.norm_type == "inf" else f"{float(case.clip.norm_type)!r}"


def clip(case: Case, params: str = "model.parameters()", full: bool = True, norm: str = "norm",
         own: bool = True) -> list[str]:
    """The clip (``norm``: the total norm, as a full tensor where ``full``, as torchtitan reads it). The clip "own"
    is the sharded model's own ``clip_grad_norm_`` (FSDP1's, as kernel/loop.py's clip_grads calls it: max_norm and
    norm_type only) where ``own``, else (the plain replay) torch.nn.utils' on the whole grads, as the reference."""
    c = case.clip
    if not c:
        return []
    if c.how == "own" and own:
        return [f"{norm} = model.clip_grad_norm_({c.max_norm!r}, norm_type={_norm_type(case)})  # the model's own"]
    fe = [f"foreach={c.foreach!r}"] * (c.foreach is not None)
    full = full and _says(case, "DTENSOR_GRADS")
    whole = f"{norm} = {norm}.full_tensor() if isinstance({norm}, DTensor) else {norm}  # the full norm, as torchtitan reads it"
    if c.how == "value":
        return [f"torch.nn.utils.clip_grad_value_({', '.join([params, repr(c.max_norm)] + fe)})"]
    kw = [f"norm_type={_norm_type(case)}"] + ["error_if_nonfinite=True"] * c.error_if_nonfinite + fe
    if c.how == "two_part":  # torchtitan's: the total norm, made full, then the clip by it
        return [f"{norm} = torch.nn.utils.get_total_norm([q.grad for q in {params} if q.grad is not None], "
                f"{', '.join(kw)})", *([whole] if full else []),
                f"torch.nn.utils.clip_grads_with_norm_({', '.join([params, repr(c.max_norm), norm] + fe)})"]
    return [f"{norm} = torch.nn.utils.clip_grad_norm_({', '.join([params, repr(c.max_norm)] + kw)})",
            *([whole] if full else [])]


def global_loss(case: Case, world: int) -> list[str]:
    """Lines leaving ``full_loss``: the step's global mean loss as a float, as the kernel feeds ReduceLROnPlateau
    (a writer's own ``global_loss(case, world)`` where its ranks hold slices of the batch or a DTensor loss)."""
    own = getattr(_writer(case), "global_loss", None)
    return own(case, world) if own else ["full_loss = float(loss.full_tensor() if isinstance(loss, DTensor) else loss)"]


def step(case: Case, opt: str = "opt", sched: str = "sched", scaler: str = "scaler", loss: str = "full_loss") -> list[str]:
    """The optimizer's step (through the scaler: skipped on an inf), the scaler's update, the scheduler's step."""
    out = [f"{scaler}.step({opt})  # skipped where unscale_ found an inf", f"{scaler}.update()"] if case.scaler \
        else [f"{opt}.step()"]
    if case.lr_scheduler:
        out.append(f"{sched}.step({loss})  # fed the step's global loss" if plateau(case) else f"{sched}.step()")
    return out


def record(case: Case, grads: str | None) -> list[str]:
    """What a parity replay needs of the step's loop, one dict a step."""
    parts = []
    if case.clip and case.clip.how != "value":
        parts.append("\"norm\": norm")
    if case.clip:
        parts.append(f"\"clipped\": {grads}")
    if case.scaler:
        parts.append("\"scale\": scaler.get_scale()")
    if case.lr_scheduler:  # (a writer's LAST_LR where a rank's scheduler steps only some of the case's groups: pp)
        parts.append(f"\"lr\": {getattr(writer(case.target), 'LAST_LR', '[float(v) for v in sched.get_last_lr()]')}")
    if plateau(case):
        parts.append("\"loss\": full_loss")
    text = "ran.append({" + ", ".join(parts) + "})"
    if len(text) <= 120 or not case.clip:
        return [text]
    rest = [p for p in parts if not p.startswith("\"clipped\"")]  # the clipped grads on a line of their own
    return ["ran.append({" + ", ".join(rest) + ","] * bool(rest) + \
        [("ran.append({" if not rest else " " * 12) + next(p for p in parts if p.startswith("\"clipped\"")) + "})"]


# ---- the checkpoint: the scheduler's and the scaler's state beside it --------

def _state(case: Case, sched: str = "sched", scaler: str = "scaler") -> str:
    return "{" + ", ".join([f"\"lr_scheduler\": {sched}.state_dict()"] * bool(case.lr_scheduler) +
                           [f"\"scaler\": {scaler}.state_dict()"] * bool(case.scaler)) + "}"


def save(case: Case, group: str, keep: bool) -> list[str]:
    """Loop.save: a DCP checkpoint's loop state as a Stateful in its own DCP save (torchtitan's), else torch.save
    on rank 0. ``keep``: hold a plain copy (``saved_loop``) for the round trip's check."""
    if not stateful(case):
        return []
    out = [f"loop_sd = {_state(case)}  # the scheduler's and scaler's state, saved beside them"]
    if case.checkpoint.kind == "dcp":
        pg = f", process_group={group}" if group else ""
        out.append(f"dcp.save({{\"loop\": loop_sd}}, storage_writer=dcp.FileSystemWriter(f\"{{ckpt}}/loop\"){pg})")
    else:
        out += ["if rank == 0:", "    torch.save(loop_sd, f\"{ckpt}/loop.pt\")"]
    return out + ["saved_loop = comparable(loop_sd)"] * keep


def load(case: Case, group: str, keep: bool) -> list[str]:
    if not stateful(case):
        return []
    if case.checkpoint.kind == "dcp":
        pg = f", process_group={group}" if group else ""
        out = [f"loop_sd = {{\"loop\": {_state(case)}}}  # the layout to load into",
               f"dcp.load(loop_sd, storage_reader=dcp.FileSystemReader(f\"{{ckpt}}/loop\"){pg})",
               "loop_sd = loop_sd[\"loop\"]"]
    else:
        out = ["loop_sd = torch.load(f\"{ckpt}/loop.pt\", weights_only=False)"]
    out += ["sched.load_state_dict(loop_sd[\"lr_scheduler\"])"] * bool(case.lr_scheduler)
    out += ["scaler.load_state_dict(loop_sd[\"scaler\"])"] * bool(case.scaler)
    return out + [f"loaded_loop = comparable({_state(case)})"] * keep


PLAIN = ["def comparable(v):  # a state dict as plain Python values (tensors as lists), to compare",
         "    if isinstance(v, dict):", "        return {k: comparable(x) for k, x in v.items()}",
         "    return [comparable(x) for x in v] if isinstance(v, (list, tuple)) else v.tolist() if torch.is_tensor(v) else v"]


def check_loaded() -> list[str]:
    """(rank 0) The loop's state right after the load vs what was saved, key by key (kernel/checkpoint.py
    check_loaded_loop)."""
    return ["    fail += [f\"{part} {k}: saved {v!r}, loaded {loaded_loop[part].get(k)!r}\" for part, sd in saved_loop.items()",
            "             for k, v in sd.items() if v != loaded_loop[part].get(k)]"]


# ---- the parity replay: the plain model's own loop on the sharded grads ----------

def clip_ulps(case: Case) -> str:
    """``CLIP_ULPS``, the kernel's bound of the total norm and the clipped grads (reference.clip_tolerance),
    written over what the script counts at run time: the grads' bound (GRAD_ULPS) plus a reduction over the
    grad elements (those of the params that have a grad at that step). The kernel's bound is affine in both:
    asked at two counts, it gives the script's slope and constant (and is checked to be so at a third)."""
    from ..kernel.oracles import UNIT_ROUNDOFF
    from ..kernel.reference import clip_tolerance

    u = UNIT_ROUNDOFF[case.dtype]
    at = lambda grad_ulps, numel: clip_tolerance(case, {"k_ulps": grad_ulps, "u": u, "why": ""}, numel)["k_ulps"]
    base, per = at(0, 0), at(0, 1) - at(0, 0)
    if at(1, 0) != base + 1 or at(0, 7) != base + 7 * per:
        raise ValueError("reference.clip_tolerance is no longer affine in the grads' bound and the grad count: "
                         "write its new form here")
    why = "a max: exact, but for the grads it is read from" if not (base or per) else \
        "a norm over the grad elements, reduced in another order"
    count = f" + {per} * sum(q.numel() for q in plain.parameters() if q.grad is not None)" * bool(per)
    return f"CLIP_ULPS = GRAD_ULPS{count}{f' + {base}' * bool(base)}  # the kernel's bound: {why}"


def replay(case: Case, what: str) -> tuple[list[str], list[str]]:
    """(the lines that replace the plain step, the loop's own checks after it) for step k of a parity replay:
    the plain scaler scales and unscales the sharded grads (powers of two: exact; it finds the inf where the
    sharded run did), the plain clip's norm and clipped grads checked against the sharded run's, then the step
    from the sharded clipped grads (only the step differs), the scaler's update and the scheduler's step."""
    out = []
    if case.scaler and what != "clip":
        out += ["scale = scaler_p.scale(torch.ones((), device=device))  # the sharded grads scaled as they were",
                "with torch.no_grad():  # ... then unscaled (powers of two: exact)", "    for n, q in plain.named_parameters():",
                "        q.grad = None if got[k][n] is None else got[k][n] * scale",
                "scaler_p.unscale_(opt_p)  # finds an inf where the sharded run's found one"]
    if case.clip and what in ("", "clip", "param", "state"):
        out += clip(case, "plain.parameters()", full=False, norm="norm_p", own=False)
        if what in ("", "clip"):
            out.append(clip_ulps(case))
            if case.clip.how != "value":
                out.append("fail.append(check(f\"step {k} total norm\", ran[k][\"norm\"], norm_p, CLIP_ULPS))")
            out += ["fail += [check(f\"step {k} clipped grad {n}\", ran[k][\"clipped\"][n], q.grad, CLIP_ULPS)",
                    "         for n, q in plain.named_parameters()]"]
        if what != "clip":
            out += ["with torch.no_grad():  # the plain optimizer steps from the sharded clipped grads: only the step differs",
                    "    for n, q in plain.named_parameters():", "        q.grad = ran[k][\"clipped\"][n]"]
    if what == "clip":
        return out, []
    out += step(case, "opt_p", "sched_p", "scaler_p", "ran[k][\"loss\"]")
    checks = []
    if what in ("", "loop") and case.scaler:
        checks += ["if ran[k][\"scale\"] != scaler_p.get_scale():",
                   "    fail.append(f\"step {k} scale: sharded {ran[k]['scale']}, plain {scaler_p.get_scale()}\")"]
    if what in ("", "loop") and case.lr_scheduler:
        checks += ["lrs = [float(v) for v in sched_p.get_last_lr()]",
                   "fail += [f\"step {k} get_last_lr(): sharded {ran[k]['lr']}, plain {lrs}\"] * (ran[k][\"lr\"] != lrs)"]
    return out, checks


def same_norm() -> list[str]:
    """Every rank's total norm is the same number (a user logs and clips by it): one all_gather."""
    return ["every = [None] * dist.get_world_size()  # every rank's total norm at each step: the same number",
            "dist.all_gather_object(every, [str(float(r[\"norm\"])) for r in ran])",
            "fail += [f\"step {k} total norm: the ranks' differ: {[e[k] for e in every]}\" for k in range(len(ran)) "
            "if len({e[k] for e in every}) > 1]"]


def same_scale(case: Case) -> list[str]:
    """Under a partial overflow: every rank's scale after each step is the same number (each rank's scaler
    backs off only where it skipped: a rank that stepped apart keeps another scale), one all_gather."""
    if not _partial(case):
        return []
    return ["every = [None] * dist.get_world_size()  # every rank's scale after each step: the same skip decision",
            "dist.all_gather_object(every, [float(r[\"scale\"]) for r in ran])",
            "fail += [f\"step {k} scale: the ranks' differ (one skipped the step, another did not): {[e[k] for e in every]}\"",
            "         for k in range(len(ran)) if len({e[k] for e in every}) > 1]"]
