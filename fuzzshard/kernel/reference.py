"""The anchored reference: replay the plain model step by step from the
sharded run's own state and compare (see run.py for the whole picture).

Before step k the reference loads the sharded params and optimizer state
after step k-1, so float noise never compounds; loss and grads are compared
with the reduction tolerance (plus measured sensitivity), and the optimizer
step, taken from the sharded grads, with the step tolerance.
"""
from __future__ import annotations

import copy
import math
import traceback

import torch
from torch.utils._pytree import tree_map_only

from ..case import Case
from .localize import Trace, localize_divergence
from .model import build_model, make_batch, objective, out_dim, param_shapes
from .optim import add_late_groups, adds_groups_before, build_optimizer, group_hparams, load_state_by_fqn, resume_defaults, state_by_fqn
from .oracles import UNIT_ROUNDOFF, compare, compare_hparams, mixed_precision_tolerance, reduction_tolerance, step_tolerance


MAX_REPORTED = 8


def step_tolerance_for(case: Case, numel: int) -> dict:
    """Adafactor reduces over a param (row/column means); Muon's Newton-Schulz
    runs in bfloat16 whatever the param dtype, one reduction per iteration."""
    if case.optim.name == "Adafactor":
        return step_tolerance(case.dtype, 4 * numel)
    if case.optim.name == "Muon":
        return step_tolerance("bfloat16", case.optim.kwargs.get("ns_steps", 5))
    return step_tolerance(case.dtype)


def torch_dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)


def _plain_setup(case: Case, device: str):
    model = build_model(case.model, case.seed, device, torch_dtype(case))
    for n in case.frozen:
        model.get_parameter(n).requires_grad_(False)
    return model, build_optimizer(model, case)


def _before_step(model, opt, case: Case, k: int) -> None:
    """A step's freezes and unfreezes, and the groups the case adds before it."""
    _apply_flags(model, case.schedule[k])
    if adds_groups_before(case, k):
        add_late_groups(opt, model, case)


def _apply_flags(model, step) -> None:
    for n in step.freeze:
        model.get_parameter(n).requires_grad_(False)
    for n in step.unfreeze:
        model.get_parameter(n).requires_grad_(True)


def _plain_reference_error(case: Case, device: str) -> dict | None:
    """Run the plain reference schedule un-anchored; its exception, if any."""
    try:
        model, opt = _plain_setup(case, device)
        for k, step in enumerate(case.schedule):
            _before_step(model, opt, case, k)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, torch_dtype(case))
            options, world = _options_at(case, k)
            if options.get("mp"):  # the same casts, or the same dtype errors
                grads = _mixed_precision(case, model, options, world, x, y)[1]
                for n, p in model.named_parameters():
                    p.grad = grads[n]
            else:
                x, y, scale = _active(case, k, x, y)
                (objective(model, x, y, options) * scale).backward()
            opt.step()
    except Exception as e:
        return _exc(e)
    return None


def reduction_length(case: Case) -> int:
    """Longest chain of summed terms behind a loss or grad element (see oracles)."""
    if case.model.factory:
        return _user_reduction_length(case)
    dims, kernel, depth = [case.model.d_in], 1, 1

    def walk(layers, mult):
        nonlocal kernel, depth
        for layer in layers:
            dims.extend([layer.d_in, layer.d_out])
            kernel = max(kernel, layer.kernel)
            if layer.kind in ("linear", "embedding", "conv1d", "layernorm"):
                depth += mult
            walk(layer.children, mult * (2 if layer.kind == "twice" else 1))

    walk(case.model.layers, 1)
    return case.batch * case.seq * max(dims) * kernel * (depth + 1)


def _user_reduction_length(case: Case) -> int:
    """A plugin's model, read from its params: the widest dim of any param
    (a matmul's contraction), the kernel of any conv-like param (dims past
    the second), and as depth the modules holding params. Counting every
    param module as one more link in the chain over-counts the parallel ones
    (q, k, v), which covers the parameter-free reductions between them
    (attention's two matmuls, a norm's mean)."""
    shapes = param_shapes(case.model)
    dims = [case.model.d_in, out_dim(case.model)] + [d for s in shapes.values() for d in s]
    kernel = max([math.prod(s[2:]) for s in shapes.values() if len(s) > 2] or [1])
    depth = len({n.rsplit(".", 1)[0] for n in shapes}) + 1
    return case.batch * case.seq * max(dims) * kernel * (depth + 1)


def check_parity(case: Case, obs: dict, device: str, localize: bool = False, step_device=None) -> dict:
    """``step_device(options, device)``: where the sharded run's optimizer
    steps under a step's target options; where that is not ``device`` (CPU
    offload) the reference steps a twin of its model and optimizer there."""
    dtype = torch_dtype(case)
    try:
        model, opt = _plain_setup(case, device)
        twins = {device: (model, opt)}
        for d in {step_device(_options_at(case, k)[0], device) for k in range(len(case.schedule))} if step_device else ():
            if d not in twins:
                twins[d] = _plain_setup(case, d)
    except Exception as e:
        return {"status": "invalid", "reason": f"reference rejects the config: {_exc(e)['text']}"}
    red_tol = reduction_tolerance(case.dtype, reduction_length(case))
    numel = max([p.numel() for p in model.parameters()] or [1])
    step_tol = step_tolerance_for(case, numel)
    params = dict(model.named_parameters())
    mismatches = _compare_state(-1, obs["init_state"], state_by_fqn(opt, model, lambda t: t), step_tol)
    prev = {"params": obs["init"], "state": obs["init_state"], "grads": {n: None for n in params}}
    for k, step in enumerate(case.schedule):
        rec = obs["steps"][k]
        if case.checkpoint and k == case.checkpoint.after + 1:
            # a resumed run starts without grads (they are not checkpointed) and from the
            # state as loaded: the values were checked equal to the saved ones, and the
            # dtype is what optimizer.load_state_dict gives (it casts float32 NAdam
            # mu_product to a float64 param's dtype)
            loaded = obs.get("loaded") or {}
            for _, o in twins.values():
                resume_defaults(o, case)
            prev = {**prev, "grads": {n: None for n in params}, "state": loaded.get("state", prev["state"]),
                    "params": loaded.get("params", prev["params"])}  # a non-strict load may miss a param
        stepper = twins[step_device(_options_at(case, k)[0], device) if step_device else device]
        try:
            for m, o in twins.values():
                _before_step(m, o, case, k)
            _anchor(model, opt, case, prev)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            options, world = _options_at(case, k)
            trace, extra = None, {}
            if options.get("mp"):
                loss, grads, tol, sens, extra = _mixed_precision(case, model, options, world, x, y)
            else:
                x, y, scale = _active(case, k, x, y)
                sens = _sensitivity(model, params, x, y, options, scale)
                trace = Trace(model, lambda t: t, lambda t: t) if localize and rec["trace"] else None
                loss = objective(model, x, y, options) * scale
                loss.backward()
                grads, tol = {n: p.grad for n, p in params.items()}, red_tol
            here = [compare("loss", k, "", rec["loss"], loss.detach(), tol, sens=sens["loss"])]
            here += [compare("grad", k, n, rec["grads"][n], grads[n], tol, sens=sens.get(n, 0.0), extra=extra.get(n))
                     for n in params]
            here = [m for m in here if m]
            if trace:  # name the module behind this step's divergence, if it has one
                culprit = localize_divergence(rec["trace"], trace.take(), red_tol) if here else None
                trace.remove()
                if culprit:
                    culprit["step"] = k
                    return _finding([m for m in mismatches if m] + [culprit] + here)
            mismatches += here
            if stepper[0] is not model:
                _anchor(*stepper, case, prev)
            with torch.no_grad():  # step from the sharded grads: isolates the optimizer
                for n, p in stepper[0].named_parameters():
                    g = rec["grads"][n]
                    p.grad = None if g is None else g.to(p.device).clone()
            stepper[1].step()
        except Exception as e:
            ref_error = _plain_reference_error(case, device)
            if ref_error is not None:
                return {"status": "invalid", "reason": f"reference raises: {ref_error['text']}"}
            return _finding([m for m in mismatches if m] + [{"quantity": "reference replay", "step": k, "fqn": "", "detail": f"the reference could not replay the sharded state: {_exc(e)['text']}"}])
        rel = _grad_uncertainty(case, rec)
        model_s, opt_s = stepper
        for n, p in model_s.named_parameters():
            extra = None if n not in rel else PARTIAL_GRAD_READS * rel[n] * (p.detach() - prev["params"][n].to(p.device)).abs()
            mismatches.append(compare("param", k, n, rec["params"][n], p.detach(), step_tol, extra=extra))
        mismatches += _compare_state(k, rec["state"], state_by_fqn(opt_s, model_s, lambda t: t), step_tol, rel)
        mismatches.append(compare_hparams(k, rec["groups"], group_hparams(opt_s)))
        prev = rec
    mismatches = [m for m in mismatches if m]
    if mismatches:
        return _finding(mismatches)
    return {"status": "pass"}


def _active(case: Case, k: int, x, y) -> tuple:
    """(inputs, targets, loss scale) of step k: with uneven inputs only the
    ranks that still run it contribute their slices, and DDP averages over
    the whole world: the grad of sum over active ranks of their mean loss / W."""
    counts = case.target_options.get("uneven")
    if not counts:
        return x, y, 1.0
    per = x.shape[0] // len(counts)
    active = [r for r, n in enumerate(counts) if n > k]
    pick = torch.cat([torch.arange(r * per, (r + 1) * per) for r in active]).to(x.device)
    return x[pick], y[pick], len(active) / len(counts)


def _options_at(case: Case, k: int) -> tuple[dict, int]:
    """The target options and world size step k ran with (the loading side's after a checkpoint)."""
    ck = case.checkpoint
    return (ck.target_options, ck.world_size) if ck and k > ck.after else (case.target_options, case.world_size)


def _mixed_precision(case: Case, model, options: dict, world: int, x, y) -> tuple:
    """fsdp2's MixedPrecisionPolicy, replayed with the same casts: each
    data-parallel rank's slice runs forward/backward on a copy of the model
    whose params are in param_dtype, with FSDP2's casts at every unit (float
    inputs to param_dtype when cast_forward_inputs, outputs to output_dtype;
    buffers keep their dtype). With gradient accumulation each rank runs its
    microbatches (loss / m each) and adds their grads in reduce_dtype, in
    place, as FSDP2 accumulates unsynced unsharded grads. Each rank's grads
    are cast to reduce_dtype and averaged exactly. The sharded run reduces the
    same W values in reduce_dtype (W-1 sums, a pre- and a post-divide, the
    cast back) after m-1 accumulating adds: see mixed_precision_tolerance, of
    sum|microbatch grads|/W. Per-rank compute is the same
    code on the same values, up to kernel rounding, which the sensitivity
    (one-ulp nudges in param_dtype) bounds.
    Returns (loss, grads, tolerance, sensitivity, elementwise allowance)."""
    mp, orig = options["mp"], torch_dtype(case)
    compute_name = mp["param_dtype"] or case.dtype
    reduce_name = mp["reduce_dtype"] or compute_name
    compute, reduce = getattr(torch, compute_name), getattr(torch, reduce_name)
    out_dtype = getattr(torch, mp["output_dtype"]) if mp["output_dtype"] else None
    low = copy.deepcopy(model)
    with torch.no_grad():
        for p in low.parameters():
            p.grad = None
            p.data = p.data.to(compute)
    for fqn in ["", *options.get("wrap", [])]:
        unit = low.get_submodule(fqn)
        if mp["cast_forward_inputs"] and mp["param_dtype"]:
            unit.register_forward_pre_hook(lambda m, a, kw: (_cast(a, compute), _cast(kw, compute)), with_kwargs=True)
        if out_dtype is not None:
            unit.register_forward_hook(lambda m, a, out: _cast(out, out_dtype))
    params = dict(low.named_parameters())
    per, m = x.shape[0] // world, options.get("microbatches", 1)
    loss, total, spread, sens = 0.0, {}, {}, {}
    for r in range(world):
        acc = {}
        for xm, ym in zip(x[r * per:(r + 1) * per].chunk(m), y[r * per:(r + 1) * per].chunk(m)):
            for key, v in _sensitivity(low, params, xm, ym, options, 1.0 / m).items():
                sens[key] = sens.get(key, 0.0) + v / world
            for p in params.values():
                p.grad = None
            local = objective(low, xm, ym, options) / m
            local.backward()
            loss += local.detach().double() / world
            for n, p in params.items():
                if p.grad is not None:
                    if n in acc:
                        acc[n] += p.grad  # in reduce_dtype, rounded once per add
                    else:
                        acc[n] = p.grad.to(reduce)
                    spread[n] = spread.get(n, 0) + p.grad.double().abs()
        for n, g in acc.items():
            total[n] = total.get(n, 0) + g.double()
    tol = mixed_precision_tolerance(compute_name, reduce_name, world, m)
    grads = {}
    for n, p in model.named_parameters():  # FSDP2 adds to a grad the param still holds (frozen, or zeroed not None)
        new = (total[n] / world).to(orig) if n in total else None
        grads[n] = p.grad if new is None else new if p.grad is None else p.grad + new
    extra = {n: tol["k_ulps"] * tol["u"] * spread[n] / world for n in spread}
    return loss.to(orig), grads, tol, sens, extra


def _cast(tree, dtype):
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)


SENSITIVITY_DRAWS = 4


def _sensitivity(model, params: dict, x, y, options: dict, scale: float = 1.0) -> dict[str, float]:
    """How far one ulp moves each result: rerun forward/backward with every
    param and float input nudged by one ulp (random direction, fixed seed),
    and take the largest change per tensor. Rounding anywhere in a legitimate
    run acts like such nudges, so k times this bounds it even where a result
    cancels to ~0 (e.g. through a LayerNorm over a near-constant row)."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(1234)  # fixed: a replay measures the same bound

    def nudge(t):
        up = torch.rand(t.shape, generator=g) < 0.5
        return torch.nextafter(t, torch.where(up.to(t.device), torch.tensor(float("inf"), dtype=t.dtype, device=t.device),
                                              torch.tensor(float("-inf"), dtype=t.dtype, device=t.device)))

    def run(perturb: bool):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(nudge(saved[n]) if perturb else saved[n])
                p.grad = None
        xin = nudge(x) if perturb and x.is_floating_point() else x
        loss = objective(model, xin, y, options) * scale
        loss.backward()
        return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}

    la, ga = run(False)
    out = {"loss": 0.0}
    for _ in range(SENSITIVITY_DRAWS):  # one draw can read 0 by chance (a flat rounding step)
        lb, gb = run(True)
        out["loss"] = max(out["loss"], float((la - lb).abs().max()))
        for n in params:
            if ga[n] is not None and gb[n] is not None and ga[n].numel():
                out[n] = max(out.get(n, 0.0), float((ga[n] - gb[n]).abs().max()))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
            p.grad = grads_before[n]
    return out


def _compare_state(k: int, got_state: dict, want_state: dict, tol: dict, rel: dict | None = None) -> list:
    """Step -1 is the state right after the optimizer constructor."""
    out = []
    for n in sorted(set(want_state) | set(got_state)):
        got, want = got_state.get(n, {}), want_state.get(n, {})
        for key in sorted(set(got) | set(want)):
            w = want.get(key)
            extra = None
            if rel and n in rel and w is not None and w.shape == rel[n].shape:
                extra = PARTIAL_GRAD_READS * rel[n] * w.abs()
            out.append(compare(f"state.{key}", k, n, got.get(key), w, tol, extra=extra))
    return out


# An elementwise optimizer reads the grad at most twice in one formula (g / |g|
# in Adagrad's first step); each read may carry its own reduction error.
PARTIAL_GRAD_READS = 4


def _grad_uncertainty(case: Case, rec: dict) -> dict:
    """Per param whose grad was Partial: the relative error, per element, of any
    one reduction of it. Summing n partials in two orders differs by at most
    2(n-1) u sum|partials|, plus u|g| for the final rounding; where the partials
    cancel (|g| << sum|partials|) the step is legitimately undetermined."""
    u = UNIT_ROUNDOFF[case.dtype]
    out = {}
    for n, (abs_sum, parts) in rec.get("grad_spread", {}).items():
        g = rec["grads"][n]
        delta = (2 * (parts - 1) + 1) * u * abs_sum.to(g.device)
        out[n] = delta / g.abs().clamp_min(torch.finfo(g.dtype).tiny)
    return out


def _anchor(model, opt, case: Case, rec: dict) -> None:
    """Make the reference exactly the sharded run's state after the previous
    step. The grads too: zero_grad clears only the optimizer's params, so the
    grad of a param in no group yet (added mid-run) accumulates over steps."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec["params"][n])
            g = rec["grads"][n]
            p.grad = None if g is None else g.to(p.device).clone()
    load_state_by_fqn(opt, model, rec["state"])


def _finding(mismatches: list[dict], oracle: str = "parity") -> dict:
    return {
        "status": "finding",
        "oracle": oracle,
        "first": mismatches[0],
        "mismatches": mismatches[:MAX_REPORTED],
        "count": len(mismatches),
    }


def _exc(e: BaseException) -> dict:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)][0]
        if isinstance(inner, BaseException):
            out = _exc(inner)
            out["traceback"] = (out["traceback"] + "".join(traceback.format_exception(e)))[-4000:]
            return out
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {
        "type": type(e).__name__,
        "message": msg[:500],
        "text": f"{type(e).__name__}: {msg[:300]}",
        "traceback": "".join(traceback.format_exception(e))[-4000:],
    }
