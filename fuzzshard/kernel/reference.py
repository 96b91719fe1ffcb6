"""The anchored reference: replay the plain model step by step from the
sharded run's own state and compare (see run.py for the whole picture).

Before step k the reference loads the sharded params and optimizer state
after step k-1, so float noise never compounds; loss and grads are compared
with the reduction tolerance (plus measured sensitivity), and the optimizer
step, taken from the sharded grads, with the step tolerance.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..case import Case
from ..verdict import Mismatch, error_record, finding, invalid, passing
from .localize import Trace, localize_divergence
from .dropout import compares_loss_and_grads, mode, replay_step, replayed
from .loop import Loop
from .model import make_batch, out_dim, param_shapes
from .moe import expert_biases, margin, moe_configs_of, set_biases, update_expert_bias
from .optim import group_hparams, resume_defaults, state_by_fqn
from .oracles import (SCALAR_STATE, UNIT_ROUNDOFF, compare, compare_hparams, compiled_scalar_state_tolerance,
                      compiled_state_allowance, compiled_step_allowance, reduction_tolerance,
                      step_tolerance)
from .plain import anchor, before_step, options_at, sensitivity, setup, torch_dtype


def step_tolerance_for(case: Case, numel: int, target_cls) -> dict:
    """Adafactor reduces over a param (row/column means); Muon's Newton-Schulz
    runs in bfloat16 whatever the param dtype, one reduction per iteration."""
    if case.optim.name == "Adafactor":
        return step_tolerance(case.dtype, 4 * numel)
    if case.optim.name == "Muon":
        return step_tolerance("bfloat16", case.optim.kwargs.get("ns_steps", 5))
    return target_cls.step_tolerance(case, step_tolerance(case.dtype))  # fsdp2's compiled step widens it


def scalar_dtype(case: Case) -> str:
    """The dtype torch.optim keeps ``step`` in (``optimizer._get_scalar_dtype``:
    float32 for a fused step, else float64 only under a float64 default dtype),
    which a compiled step computes its scalar factors in."""
    from torch.optim.optimizer import _get_scalar_dtype

    return str(_get_scalar_dtype(is_fused=bool(case.optim.kwargs.get("fused")))).removeprefix("torch.")


def reference_error(case: Case, device: str, target_cls) -> dict | None:
    """Run the plain reference schedule un-anchored; its exception's record, if any."""
    try:
        model, opt = setup(case, device)
        loop = Loop(case, _scaler_path(target_cls, opt))
        for k, step in enumerate(case.schedule):
            before_step(model, opt, case, k)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, torch_dtype(case))
            options, world = options_at(case, k)
            scaled = loop.scale_loss(k) or (lambda t: t)
            # the same casts, or errors; with the loss scaled as the grad scaler scales it (not its drawn overflow)
            own = target_cls.reference_loss_grads(case, model, options, world, x, y, **loop.scale_kwargs())
            if own is not None:
                loss = own[0]
                for n, p in model.named_parameters():
                    p.grad = None if own[1][n] is None else scaled(own[1][n])
            else:
                x, y, scale = target_cls.reference_batch(case, k, x, y)
                scale_held(model, target_cls.held_grad_scale(case, k))
                loss = target_cls.objective(model, x, y, options) * scale
                scaled(loss).backward()
            loop.inject_full(k, {n: p.grad for n, p in model.named_parameters()})  # a partial overflow
            loop.unscale()
            loop.clip(list(model.parameters()))
            loop.step(loss.detach())
    except Exception as e:
        return error_record(e)
    return None


def scale_held(model, s: float) -> None:
    """The grads held into this step (``Target.held_grad_scale``) times ``s``, before its backward adds to them."""
    if s != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(s)


def _scaler_path(target_cls, opt):
    """``opt``, stepped by a grad scaler as the target's optimizer is: where that
    is a wrapper that does not take the scaler's found_inf (``amp_scaling_step``
    False: ZeRO, ShardedOptimizer), GradScaler skips its whole step on an inf,
    so a fused reference optimizer is not handed found_inf either (its kernel
    would skip the update but still make state)."""
    if not target_cls.amp_scaling_step:
        opt._step_supports_amp_scaling = False
    return opt


def reduction_length(case: Case) -> int:
    """Longest chain of summed terms behind a loss or grad element (see oracles)."""
    if case.model.factory:
        return _user_reduction_length(case)
    return math.prod(reduction_parts(case))


def reduction_parts(case: Case) -> tuple[int, int, int, int, int]:
    """reduction_length of a built-in topology as its factors (a standalone
    script shows them): batch, seq, widest dim, conv kernel, depth + 1."""
    dims, kernel, depth = [case.model.d_in], 1, 1

    def walk(layers, mult):
        nonlocal kernel, depth
        for layer in layers:
            dims.extend([layer.d_in, layer.d_out])
            kernel = max(kernel, layer.kernel)
            if layer.kind in ("linear", "embedding", "conv1d", "layernorm"):
                depth += mult
            if layer.kind == "moe":  # the gate, each expert's two matmuls, the combine over top_k: 4 deep
                c = layer.moe
                dims.extend([c.get("hidden", 1), c.get("shared", 0), c.get("experts", 2)])
                depth += 4 * mult
            walk(layer.children, mult * (2 if layer.kind == "twice" else 1))

    walk(case.model.layers, 1)
    return case.batch, case.seq, max(dims), kernel, depth + 1


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


def check_parity(case: Case, obs: dict, device: str, target_cls, localize: bool = False, clock=None) -> dict:
    """The parity verdict (``_check_parity``); a case with dropout replays each step's masks (kernel/dropout.py)."""
    try:
        return _check_parity(case, obs, device, target_cls, localize, clock)
    finally:
        replay_step(None)


def _check_parity(case: Case, obs: dict, device: str, target_cls, localize: bool = False, clock=None) -> dict:
    """``target_cls``: the target the sharded run ran, for its reference hooks
    (base.Target): where its optimizer steps under a step's target options
    (where that is not ``device``, CPU offload, the reference steps a twin of
    its model and optimizer there), the batch and the loss and grads it
    computes where they are not the plain model's. ``clock``: run.Clock,
    to time the comparisons apart from the replay."""
    part = clock or (lambda name: contextlib.nullcontext())
    dtype = torch_dtype(case)
    step_device = target_cls.step_device
    try:
        model, opt = setup(case, device)
        twins = {device: (model, opt)}
        for d in {step_device(options_at(case, k)[0], device) for k in range(len(case.schedule))}:
            if d not in twins:
                twins[d] = setup(case, d)
    except Exception as e:
        return invalid(f"reference rejects the config: {error_record(e)['text']}")
    # the loop around each twin's step (loop.py)
    loops = {d: Loop(case, _scaler_path(target_cls, o)) for d, (_, o) in twins.items()}
    red_tol = reduction_tolerance(case.dtype, reduction_length(case))
    numel = max([p.numel() for p in model.parameters()] or [1])
    step_tol = step_tolerance_for(case, numel, target_cls)
    params = dict(model.named_parameters())
    mismatches = _compare_state(-1, obs["init_state"], state_by_fqn(opt, model, lambda t: t), step_tol)
    prev = {"params": obs["init"], "state": obs["init_state"], "grads": {n: None for n in params}}
    moe = bool(moe_configs_of(case.model))
    biases0 = expert_biases(model) if moe else {}  # the fresh model's (the resumed side loads the saved ones)
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
        stepper = twins[step_device(options_at(case, k)[0], device)]
        replay_step(case, k, device)
        try:
            for m, o in twins.values():
                before_step(m, o, case, k)
            anchor(model, opt, case, prev)
            if moe:  # the routing bias the sharded run routed this step by; no counts yet; the margin from here
                set_biases(model, prev.get("expert_bias", biases0))
                margin(model, reset=True)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            options, world = options_at(case, k)
            trace, extra = None, {}
            own = target_cls.reference_loss_grads(case, model, options, world, x, y,
                                                  **loops[step_device(options, device)].scale_kwargs())
            if own is not None:
                loss, grads, tol, sens, extra = own
            else:
                x, y, scale = target_cls.reference_batch(case, k, x, y)
                scale_held(model, target_cls.held_grad_scale(case, k))
                sens = None  # measured below, only if a comparison fails without it
                # dropout: each data-parallel rank's slice from its own seed (kernel/dropout.py), else the objective
                objective = replayed(target_cls.objective, target_cls.dropout_world(options, world),
                                             target_cls.microbatches(options))
                traced_here = localize and rec["trace"] and not mode(case)  # one forward a step, not several
                # the sharded run's output grads are of the scaled loss (its grad scaler): the reference's are
                # scaled alike, by the same power of two (exact)
                s = loops[step_device(options, device)].scale_kwargs().get("scale", 1.0)
                trace = Trace(model, lambda t, fqn: t, lambda t, fqn: t * s if s != 1.0 else t,
                              target_cls.trace_points(case)) if traced_here else None
                loss = objective(model, x, y, options) * scale
                loss.backward()
                grads, tol = {n: p.grad for n, p in params.items()}, red_tol
            if moe:  # this step's expert counts and routing margin, before any nudged pass below adds to them
                routed = {"margin": margin(model, reset=True), "counts": set_biases(model, None),
                          # the rounding the routing saw: the target's own passes' (mixed precision) where coarser
                          "tol": {**red_tol, "u": max(red_tol["u"], tol["u"])}}
            # an overflow in some grads only: the same non-finite value in the same element of the full grad
            loops[device].inject_full(k, grads)
            traced = None
            overflow = loops[device].overflows(k)  # the loss made infinite on purpose: no grads to compare
            if trace:  # its hooks are done with this step: off before any nudged pass below could add to it
                traced = trace.take()
                trace.remove()
                if overflow:  # the sharded run's output grads are infinite on purpose: none to compare
                    traced["bwd"] = []

            def loss_and_grads(sens: dict) -> list:
                if not compares_loss_and_grads(case):  # masks torch does not promise to be the reference's
                    return []
                out = [compare("loss", k, "", rec["loss"], loss.detach(), tol, sens=sens.get("loss", 0.0))]
                out += [compare("grad", k, n, rec["grads"][n], grads[n], tol, sens=sens.get(n, 0.0),
                                extra=extra.get(n)) for n in params if not overflow]
                return [m for m in out if m]

            with part("compare"):
                here = loss_and_grads(sens or {})
            if here and sens is None:
                # a sensitivity only widens a bound: what matches without it matches with it, so the
                # five forward/backward passes that measure it run only where something does not
                sens = sensitivity(model, params, x, y, functools.partial(objective, options=options), scale)
                with part("compare"):
                    here = loss_and_grads(sens)
            if traced is not None:  # name the module behind this step's divergence, if it has one
                culprit = localize_divergence(rec["trace"], traced, red_tol) if here else None
                if culprit:
                    culprit["step"] = k
                    return finding("parity", [m for m in mismatches if m] + [culprit] + here)
            mismatches += here
            if stepper[0] is not model:
                anchor(*stepper, case, prev)
            with torch.no_grad():  # step from the sharded grads: isolates the optimizer
                for n, p in stepper[0].named_parameters():
                    g = rec["grads"][n]
                    p.grad = None if g is None else g.to(p.device).clone()
            with part("compare"):
                mismatches += _loop_step(case, k, loops, step_device(options_at(case, k)[0], device), stepper, rec,
                                         red_tol)
        except Exception as e:
            ref_error = reference_error(case, device, target_cls)
            if ref_error is not None:
                return invalid(f"reference raises: {ref_error['text']}")
            why = f"the reference could not replay the sharded state: {error_record(e)['text']}"
            return finding("parity", [m for m in mismatches if m] + [Mismatch("reference replay", "", k, why).to_dict()])
        with part("compare"):
            rel = _grad_uncertainty(case, rec)
            model_s, opt_s = stepper
            stepped = []
            groups = {id(q): g for g in opt_s.param_groups for q in g["params"]}
            state_extra = {}  # a compiled step's allowance for state derived from the new param
            for n, p in model_s.named_parameters():
                before = prev["params"][n].to(p.device)
                update = (p.detach() - before).abs()
                extra = None if n not in rel else PARTIAL_GRAD_READS * rel[n] * update
                if "update_rel" in step_tol:  # a compiled step (oracles.compiled_step_tolerance)
                    group = groups.get(id(p))
                    allow = compiled_step_allowance(step_tol, case.optim.name, group, update, before, p.grad,
                                                    opt_s.state.get(p))
                    state_extra[n] = lambda key, group=group, allow=allow: compiled_state_allowance(
                        case.optim.name, group, key, allow)
                    extra = allow + (0 if extra is None else extra)
                stepped.append(compare("param", k, n, rec["params"][n], p.detach(), step_tol, extra=extra))
            want_state = state_by_fqn(opt_s, model_s, lambda t: t)
            # a target's own elementwise allowance for its state (fsdp2: a low-bit optimizer's quantization)
            state_extra = state_extra or target_cls.state_allowance(case, k, want_state)
            stepped += _compare_state(k, rec["state"], want_state, step_tol, rel, state_extra)
            stepped.append(compare_hparams(k, rec["groups"], group_hparams(opt_s)))
            loop_checks = _compare_loop(k, rec.get("loop") or {}, loops[step_device(options_at(case, k)[0], device)])
            # whether the scaler skipped the step comes first: a wrong decision is what the params then show
            skipped = [m for m in loop_checks if m and m["quantity"] == "loop.found_inf"]
            stepped = skipped + stepped + [m for m in loop_checks if m not in skipped]
            for m in stepped:  # a fused step that read a non-contiguous grad: part of what names the bug
                if m and m["fqn"] in rec.get("noncontig", ()):
                    m["grad"] = "non-contiguous"
            if moe:  # the routing bias after its update from the global counts (torchtitan's pre-hook)
                set_biases(model, prev.get("expert_bias", biases0), routed["counts"])
                update_expert_bias(model)
                stepped += [compare("moe.expert_bias", k, n, rec["expert_bias"].get(n), want, step_tol)
                            for n, want in expert_biases(model).items()]
            mismatches += stepped
            if moe and any(m and m.get("step") == k for m in mismatches):
                why = routing_undetermined(routed["margin"], routed["tol"])
                if why:  # the reference's routing is a near tie that rounding may flip: no comparable run
                    return invalid(why)
        # the grads the next step starts from are the clipped ones (a clip works in place): a param in no group
        # yet (added mid-run) keeps its clipped grad past zero_grad and accumulates the next backward onto it
        prev = {**rec, "grads": rec["clipped"]} if case.clip and "clipped" in rec else rec
    mismatches = [m for m in mismatches if m]
    return finding("parity", mismatches) if mismatches else passing()


# Both runs' logits differ by rounding (the reduction tolerance: k ulps of u, relative to the magnitude the
# logits are summed from); a score moves by at most twice a logit's change (softmax), on each side
ROUTING_SIDES = 4


def routing_undetermined(rel_margin: float, tol: dict) -> str | None:
    """Why a step's MoE routing is not determined by the math (a reason, or None): where the reference's
    smallest gap between a chosen and an unchosen expert's score, relative to the logits' magnitude
    (kernel/moe.py ``margin``), is within what rounding may move on either side, the sharded run may route a
    token elsewhere and every number after it legitimately differs."""
    bound = ROUTING_SIDES * tol["k_ulps"] * tol["u"]
    if rel_margin <= bound:
        return (f"MoE routing undetermined: a top-k choice within {rel_margin:.3g} (relative) of a tie, where "
                f"rounding may move scores by {bound:.3g} ({ROUTING_SIDES} x {tol['k_ulps']} ulps)")
    return None


def _compare_state(k: int, got_state: dict, want_state: dict, tol: dict, rel: dict | None = None,
                   compiled: dict | None = None) -> list:
    """Step -1 is the state right after the optimizer constructor. ``compiled``:
    {fqn: key -> a compiled step's allowance for that state, or None}."""
    out = []
    for n in sorted(set(want_state) | set(got_state)):
        got, want = got_state.get(n, {}), want_state.get(n, {})
        for key in sorted(set(got) | set(want)):
            w = want.get(key)
            extra = None
            if rel and n in rel and w is not None and w.shape == rel[n].shape:
                extra = PARTIAL_GRAD_READS * rel[n] * w.abs()
            more = compiled[n](key) if compiled and n in compiled else None
            if more is not None and w is not None and w.shape == more.shape:
                extra = more if extra is None else extra + more
            key_tol = compiled_scalar_state_tolerance(tol) if "update_rel" in tol and key in SCALAR_STATE else tol
            out.append(compare(f"state.{key}", k, n, got.get(key), w, key_tol, extra=extra))
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


# ---- the training loop around the step (loop.py): scaler, clipping, scheduler ----

LOOP_EXACT = {"k_ulps": 0, "u": 0.0, "why": "the same numbers on both sides: exact"}


def clip_tolerance(case: Case, tol: dict, numel: int) -> dict:
    """A total grad norm, and grads scaled by max_norm / norm, from the sharded
    grads: the norm is a reduction over every grad element (in per-shard
    partial norms, then across ranks, in another order than the plain one), so
    ``reduction_tolerance`` of that length on top of the grads' own; the
    infinity norm is a max: exact, but for the grads it was read from."""
    if case.clip.norm_type == "inf":
        return tol
    n = numel + 2 * len(case.groups) + 2  # the elements, a norm per tensor and the stacked norm's terms
    red = reduction_tolerance(case.dtype, n)
    return {**red, "k_ulps": red["k_ulps"] + tol["k_ulps"] + 4,
            "why": f"a norm over {numel} grad elements reduced in another order: {red['why']}"}


def _loop_step(case: Case, k: int, loops: dict, at: str, stepper: tuple, rec: dict, tol: dict) -> list:
    """Step the reference from the sharded grads (set on ``stepper``'s params)
    through the loop around it, as the sharded run did: the scaler's unscale
    (of the grads scaled by its current scale: the same powers of two, exact),
    the clip (its norm and clipped grads compared with the sharded run's, and
    then the sharded clipped grads stepped), the step (skipped on a non-finite
    grad), the scaler's update and the scheduler's step (fed the sharded loss)."""
    loop, (model_s, opt_s) = loops[at], stepper
    out = []
    if loop.scaler:
        # a partial overflow set in the sharded grads too (the gathered copy holds it already where the run
        # kept it): the reference's skip is decided by its own grads, the truth every rank must agree on
        loop.inject_full(k, {n: p.grad for n, p in model_s.named_parameters()})
        scale = loop.scaler.scale(torch.ones((), device=next(model_s.parameters(), torch.zeros(())).device))
        with torch.no_grad():
            for p in model_s.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        loop.unscale()
    if case.clip:
        params = dict(model_s.named_parameters())
        numel = sum(p.numel() for p in params.values() if p.grad is not None)
        clip_tol = clip_tolerance(case, tol, numel)
        norm = loop.clip(list(params.values()))
        if norm is not None:
            out.append(compare("clip_norm", k, "", rec.get("clip_norm"), norm, clip_tol))
        for n, p in params.items():
            out.append(compare("clipped_grad", k, n, rec["clipped"][n], p.grad, clip_tol))
        with torch.no_grad():  # the step from the sharded clipped grads: isolates the optimizer again
            for n, p in params.items():
                g = rec["clipped"][n]
                p.grad = None if g is None else g.to(p.device).clone()
    loop.step(rec["loss"])
    for d, other in loops.items():  # a twin that did not step keeps the same lrs
        if d != at:
            other.step_lr(rec["loss"])
    return out


def _compare_loop(k: int, got: dict, loop) -> list:
    """The scale and the scheduler's last lrs after step k: exact (they are not computed from the data)."""
    want = loop.observe()
    if got.get("found_inf") is not None and want.get("found_inf") is not None:  # every rank's vs the reference's
        want["found_inf"] = want["found_inf"].expand_as(got["found_inf"])
    return [compare(f"loop.{key}", k, "", got.get(key), want.get(key), LOOP_EXACT) for key in sorted(set(got) | set(want))]
