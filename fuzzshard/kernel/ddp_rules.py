"""The ddp target's draws and rules (kernel/targets/ddp.py's Spec): DDP's flags, the comm hook, accumulation, the
gated residual, ignored params, replicate(), uneven inputs under Join; what a case may not be (``check``), and
what it used (``coverage``, ``facts``). Plain functions of the case, no process group."""
from __future__ import annotations

import dataclasses
import math

from .dropout import has_dropout
from .powersgd import resumable, resume_ok, resume_sides

HOOKS = ("allreduce", "fp16", "bf16", "fp16_wrapper", "powersgd")
LOSSY = {"fp16": "float16", "bf16": "bfloat16", "fp16_wrapper": "float16"}
BUCKET_CAPS = (1e-6, 4e-5, 1e-3)  # MiB: 1 byte (a bucket per param), a few params, ~1000 floats


def _residuals(model) -> list[str]:
    """Top-level residual layers with params: what ``gate`` may skip."""
    if model is None or getattr(model, "factory", None):
        return []
    return [f"layers.{i}" for i, layer in enumerate(model.layers)
            if layer.kind == "residual" and _has_params(layer)]


def _has_params(layer) -> bool:
    return layer.kind in ("linear", "embedding", "layernorm", "conv1d") or any(_has_params(c) for c in layer.children)


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), model=None, loading: bool = False,
                 kind: str = "", **_) -> dict:
    """DDP's flags (each its default first), then now and then grad
    accumulation, a gated residual, ignored params, a comm hook, replicate()."""
    import hypothesis.strategies as st

    out, ddp = {}, {}
    if loading and draw(st.booleans()):  # the checkpoint loaded into the plain model, not the wrapper
        out["plain"] = True
    static = draw(st.booleans())
    unused = bool(model is not None and model.unused)
    gates = _residuals(model)
    gate = gates and not static and draw(st.integers(0, 3)) == 3
    if static:
        ddp["static_graph"] = True
    # an unused submodule or a gated layer needs find_unused_parameters (or static_graph) : DDP's documented error
    if gate or (unused and not static) or draw(st.booleans()):
        ddp["find_unused_parameters"] = True
    if draw(st.booleans()):
        ddp["gradient_as_bucket_view"] = True
    cap = draw(st.sampled_from((None,) + BUCKET_CAPS))
    if cap is not None:
        ddp["bucket_cap_mb"] = cap
    if draw(st.booleans()):
        ddp["broadcast_buffers"] = False
    if draw(st.booleans()):
        ddp["init_sync"] = False
    if ddp:
        out["ddp"] = ddp
    m = draw(st.sampled_from([1, 1, 2, 3]))
    if m > 1:
        out["microbatches"] = m
        if draw(st.booleans()):  # the wrapper's first step syncs every microbatch: no_sync from its second on
            out["synced_first"] = 1
    if gate:
        out["gate"] = draw(st.sampled_from(gates))
    # (not in the gated layer: a rank that skips it has no grad there to average by hand, the others do)
    trainable = sorted(n for n in shapes if not n.startswith("unused.")
                       and not (gate and n.startswith(out["gate"] + ".")))
    if len(trainable) > 1 and draw(st.integers(0, 5)) == 5:
        tied_names = {n for n in shapes if n.rsplit(".", 1)[0] in tied}
        pick = [n for n in trainable if n not in tied_names]
        if pick:
            out["ignore"] = [draw(st.sampled_from(pick))]
    if "ignore" not in out and draw(st.integers(0, 5)) == 5:
        out["replicate"] = True
    return out


def joinable(case) -> bool:
    """Join applies to DDP (it is Joinable; replicate() is not) with every
    trainable param used (a joined rank cannot tell an unused param's zero grad
    from a real one), no comm hook of the case's own (Join's DDP hook shadows
    the default all-reduce; the kernel registers its own averaging), one
    forward/backward a step, no checkpoint and no loop around the step."""
    o = case.target_options
    return (case.world_size > 1 and len(case.schedule) > 1 and case.checkpoint is None and not case.model.unused
            and not any(k in o for k in ("replicate", "hook", "gate", "microbatches", "ignore")))


def draw_late_options(draw, case) -> dict:
    """One case in two a comm hook (the saving side's); then, where ``joinable``,
    now and then uneven inputs under Join: rank r runs the first counts[r]
    steps, one rank all of them."""
    import hypothesis.strategies as st

    out = dict(case.target_options)
    # a comm hook, now and then: drawn once the device and dtype are known (bf16_compress_hook raises on CPU; the
    # compressing hooks are not drawn for a low-precision model)
    hooks = [h for h in HOOKS if not (h == "bf16" and case.device == "cpu")
             and not (h in LOSSY and case.dtype not in ("float32", "float64"))]
    if draw(st.booleans()):  # (one case in two: one in four reached the compressing hooks too rarely in a hunt)
        hook = {"name": draw(st.sampled_from(hooks))}
        if hook["name"] == "powersgd":
            hook["rank"] = draw(st.integers(1, 2))
            hook["feedback"] = draw(st.booleans())
            hook["warm"] = draw(st.booleans())
            # PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start (documented)
            hook["start"] = draw(st.integers(2 if hook["feedback"] or hook["warm"] else 1, 3))
            hook["min_rate"] = draw(st.sampled_from([0.0, 2.0]))  # 0: every matrix compressed, however small
            if resumable(case) and draw(st.booleans()):
                hook["resume"] = True
        out["hook"] = hook
        if hook.get("resume"):
            resume_sides(out, case.checkpoint.target_options)
        case = dataclasses.replace(case, target_options=out)
    if joinable(case) and draw(st.integers(0, 3)) == 3:
        n_steps, world = len(case.schedule), case.world_size
        counts = [draw(st.integers(1, n_steps)) for _ in range(world)]
        counts[draw(st.integers(0, world - 1))] = n_steps
        out["uneven"] = counts
    return out


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """uneven holds a step count per rank, one of them every step."""
    world = math.prod(mesh_shape)
    if "uneven" in options:
        counts = (options["uneven"] + [n_steps] * world)[:world]
        if max(counts) != n_steps:
            counts[-1] = n_steps
        options["uneven"] = counts
    return options


def check(case) -> str | None:
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    for o in sides:
        ddp, hook = o.get("ddp", {}), o.get("hook") or {}
        if ddp.get("static_graph") and o.get("gate"):
            return "static_graph with a graph that changes between steps (DDP's docs: the used params never change)"
        if o.get("gate") and not ddp.get("find_unused_parameters"):
            return "a gated layer without find_unused_parameters (DDP's documented error)"
        if case.model.unused and not (ddp.get("find_unused_parameters") or ddp.get("static_graph")):
            return "an unused submodule without find_unused_parameters or static_graph (DDP's documented error)"
        if o.get("gate") and o["gate"] not in _residuals(case.model):
            return f"gate {o['gate']}: no top-level residual layer with params"
        if o.get("gate") and any(n.startswith(o["gate"] + ".") for n in o.get("ignore", ())):
            return "an ignored param in the gated layer: the ranks that skip it have no grad to average by hand"
        if o.get("replicate") and o.get("ignore"):
            return "replicate() ignores modules, not params"
        if hook.get("name") == "powersgd" and (hook.get("feedback") or hook.get("warm")) and hook.get("start", 1) <= 1:
            return "PowerSGD with error feedback or warm start from iteration 1 (PowerSGDState refuses it)"
        if hook.get("resume") and o is case.target_options and not resume_ok(case):
            return ("PowerSGD's state round-tripped: want a loading side on the same ranks wrapped as the saving side "
                    "(DDP, find_unused_parameters without static_graph: the buckets the state is keyed by)")
        if hook.get("name") == "bf16" and case.device == "cpu":
            return "bf16_compress_hook on CPU (it raises: it requires CUDA 11+ and NCCL 2.10+, as documented)"
        if hook.get("name") in LOSSY and (case.dtype not in ("float32", "float64") or case.scaler):
            return "a compressing comm hook on a low-precision model or under a grad scaler (its grads overflow float16)"
    for world, o in [(case.world_size, case.target_options)] + \
            ([(case.checkpoint.world_size, case.checkpoint.target_options)] if case.checkpoint else []):
        if case.batch % (world * o.get("microbatches", 1)):
            return f"batch {case.batch}: not {world} ranks' equal slices in {o.get('microbatches', 1)} equal microbatches"
    uneven = case.target_options.get("uneven")
    if uneven and (case.clip or case.lr_scheduler or case.scaler):
        return "uneven inputs under Join: a joined rank's step is shadowed without the loop (clip, scaler, lr)"
    if uneven is not None and (len(uneven) != case.world_size or max(uneven) != len(case.schedule) or min(uneven) < 1):
        return (f"uneven inputs {uneven}: want one step count in 1..{len(case.schedule)} per rank of "
                f"{case.world_size}, one of them {len(case.schedule)}")
    if uneven and not joinable(case):
        return "uneven inputs where Join does not apply (see kernel/targets/ddp.py joinable)"
    if uneven and has_dropout(case.model):
        return "dropout with uneven inputs under Join: a joined rank's shadowed steps are not replayed"
    return None


def ac_rule(options: dict, how: str) -> str | None:
    """Non-reentrant forms only (the Spec): DDP's docs allow reentrant checkpointing only without unused
    params and with each layer checkpointed at most once. A gated layer's forward is fuzzshard's own (the
    gate replaces it): that layer itself is not checkpointed, its children and parents may be."""
    if options.get("gate") and options.get("gate") in options.get("ac", ()):
        return f"activation checkpointing of the gated layer {options['gate']} (the gate replaces its forward)"
    return None


def coverage(case) -> dict:
    """DDP's features a case used: its flags, the comm hook, accumulation, gate, Join, replicate."""
    from .targets.fsdp1 import loop_coverage

    o = case.target_options
    used = sorted(o.get("ddp", {})) + [k for k in ("microbatches", "gate", "ignore", "uneven", "replicate") if o.get(k)]
    if o.get("hook"):
        used.append(f"hook {o['hook']['name']}" + " (state checkpointed)" * bool(o["hook"].get("resume")))
    out = loop_coverage(case, "replicate()" if o.get("replicate") else "DDP")
    out["DDP features"] = used or ["defaults"]
    return out


def facts(case) -> dict:
    o = case.target_options
    return {"hook": (o.get("hook") or {}).get("name", ""), "static_graph": bool(o.get("ddp", {}).get("static_graph")),
            "no_sync": o.get("microbatches", 1) > 1, "gate": bool(o.get("gate")),
            "powersgd_resume": bool((o.get("hook") or {}).get("resume"))}
