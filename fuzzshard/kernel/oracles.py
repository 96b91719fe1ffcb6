"""Oracles: pure comparisons of what the sharded run did against the reference.

Tolerances are derived, never tuned. ``u`` is the unit roundoff of the dtype.
- *step*: the reference optimizer step starts from exactly the sharded
  params, state and grads (the reference is re-anchored every step), so the
  only legitimate difference is elementwise rounding of the same formulas
  (vectorised vs scalar tails, fused multiply-add): ``STEP_ULPS * u``, times
  the reduction length for optimizers that reduce over a param (Adafactor).
- *reduction*: loss and grads come from the same params and data but a
  different reduction order (sharded matmuls, collectives). Summing n terms
  in any order errs by at most ``n * u * sum|terms|`` (Higham); n is the
  longest reduction in the model times its depth, counted for both runs.
  ``sum|terms|`` is not visible in a result that cancels (a bias feeding a
  LayerNorm has an analytic grad of 0), so the bound also carries the
  tensor's *measured sensitivity*: how far it moves when every param and
  input is nudged by one ulp. Rounding inside a run acts like such nudges.
- *Partial grads*: a grad left Partial (unreduced) is reduced again by each
  optimizer op that reads it, in its own order; where its partials cancel
  the step is legitimately undetermined. The step bound of such a param
  grows by ``4 * r * |update|`` per element (state: ``4 * r * |state|``),
  r being the relative reduction error ``(2(n-1)+1) u sum|partials| / |g|``.
An element fails when ``|got - want| > atol + rtol * |want|`` with
``rtol = k*u`` and ``atol = k*u*max|want| + k*sensitivity``.
"""
from __future__ import annotations

import math

import torch

from ..verdict import Mismatch

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
# The error of one rounding whose result underflows (half the spacing of the dtype's subnormal numbers):
# below the smallest normal number u*|x| no longer bounds a rounding (float16's normals end at 6.1e-5)
UNDERFLOW = {
    "float64": 2.0**-1075,
    "float32": 2.0**-150,
    "bfloat16": 2.0**-134,
    "float16": 2.0**-25,
}
STEP_ULPS = 16


def step_tolerance(dtype: str, reduce_len: int = 1) -> dict:
    k = STEP_ULPS * reduce_len
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[dtype], "why": f"same inputs, elementwise rounding: {k} ulps of {dtype}"}


def compiled_step_tolerance(tol: dict, dtype: str, betas, scalar_dtype: str | None = None) -> dict:
    """``tol`` for an optimizer step run under torch.compile. Eager evaluates a
    step's scalar factors (Adam's bias corrections 1 - beta^t, their square
    roots, lr / correction) as Python doubles: ``optimizer._get_value(step)``
    is ``step.item()``. Compiled, ``_get_value`` returns the ``step`` tensor
    itself (torch/optim/optimizer.py, ``_get_value``), so they are 0-dim
    tensors of *the step's dtype*, ``scalar_dtype``: ``_get_scalar_dtype()``,
    float32 unless the default dtype is float64, whatever the params' dtype (a
    Python float meeting a 0-dim float32 tensor stays float32). So u below is
    the unit roundoff of ``scalar_dtype``, not of ``dtype``: a float64 case's
    compiled step has float32 scalars (measured, float64 params: Adam 168,
    Adamax 6, Adagrad 1 float32 ulps of |update| apart from eager, 1e-10 to
    1e-7 on 1e-2 updates; the same step compiled with float64 step tensors
    matches eager to 2e-16). beta rounds to the scalar dtype (u), its t-th power errs by t u
    more (plus u), and 1 - beta^t cancels, so its relative error is
    ((t + 2) beta^t / (1 - beta^t) + 1) u, largest at t = 1: 3 beta / (1 - beta) + 1
    (beta2 = 0.999: about 3000 u). Each correction enters the update at most
    once; a few more roundings add 4 u: lr and lr / correction (2 u), the
    square root of the second one (u); Adagrad's lr / (1 + (t-1) lr_decay)
    errs by 3 u + 2 u x / (1 + x), x = (t-1) lr_decay, under 4 u while x < 1.
    The param may then differ by that relative error of its update,
    ``update_rel * |update|`` per element, on top of the elementwise bound
    (per param, from its own group's betas: ``compiled_step_allowance``).
    Why it hides no bug: the allowance is relative to the update, so a step
    that is wrong by more than the scalars' own rounding (a correction one
    step off, a missing term) still fails, and the params' elementwise math
    (float64 in a float64 case) keeps its 16 ulps of ``dtype``.
    Not covered: RAdam's rectification, whose rho_t = rho_inf - 2 t beta2^t /
    (1 - beta2^t) cancels far worse; it applies from rho_t > 5 (step 5 or
    later), past the strategies' three steps, and needs its own bound first."""
    scalar_dtype = scalar_dtype or dtype
    u = UNIT_ROUNDOFF[scalar_dtype]
    rel = compiled_update_rel(betas, u)
    return {**tol, "update_rel": rel, "scalar_dtype": scalar_dtype,
            "why": tol["why"] + f"; compiled step: + {rel:.3g} x |update| (its scalar factors in {scalar_dtype}: "
                                f"1 - beta^t for betas {list(betas)}, at t = 1)"}


def compiled_update_rel(betas, u: float) -> float:
    """The relative error of a compiled step's update from its scalar factors
    (``compiled_step_tolerance``): (sum over betas of (3 beta / (1 - beta) + 1) + 4) u."""
    return (sum(3 * b / (1 - b) + 1 for b in betas if 0 < b < 1) + 4) * u


# NAdam's two coefficients (besides the bias correction of beta2), in roundings
# of the scalar dtype: ``compiled_step_allowance``
NADAM_COEF_ULPS = 23
# State torch.optim keeps as 0-dim tensors of the scalar dtype and a compiled
# step computes from ``step`` in that dtype (eager: in doubles, rounded once)
SCALAR_STATE = ("step", "eta", "mu", "mu_product")


def compiled_step_allowance(tol: dict, optim: str, group: dict | None, update, prev=None, grad=None,
                            state: dict | None = None):
    """Elementwise allowance for a param after a compiled step (on top of the
    16-ulp bound of ``tol``), ``tol`` from ``compiled_step_tolerance``; u is
    the unit roundoff of its scalar dtype. ``group``: the param's group in the
    reference optimizer (its own betas and lr), ``update`` |new - prev| there,
    ``prev`` the param before the step, ``grad`` its grad, ``state`` its state
    after the step.
    - ``compiled_update_rel(group betas) * |T|``: one multiplicative scalar
      factor (Adam, AdamW, Adamax, Adagrad, ...) of the update's term T:
      the update itself, or with a decoupled weight decay (p (1 - lr wd) + T,
      the decay a double in both runs) |update| + lr wd |prev| >= |T|: where
      decay and T cancel, |update| alone is no measure of T's error (measured:
      30 times the bound, AdamW lr 3e-4, wd 0.5).
    - NAdam adds two terms, T1 = -lr (1 - mu) / (1 - Pi) g / d and
      T2 = -lr mu' / (1 - Pi') m / d, each with its own float32 coefficient;
      where they cancel (T1 = -T2 to 1e-3) |update| is no measure of their
      error (measured: 434 u of |update|, 2.1 u of |T1| + |T2|). So the
      allowance is (3 beta2 / (1 - beta2) + 1 + 23) u (|T1| + |T2|): d holds
      the correction of beta2; mu = beta1 (1 - 0.5 0.96^(t psi)) errs by 5 u
      (0.96 and psi round, t psi, the power, 1 - 0.5 y around 0.5 (3 u), beta1
      and the product), 1 - mu and 1 - Pi (mu, Pi <= 0.5: no cancellation) by
      6 u and 8 u, with lr and two products c1 by 17 u; Pi' = Pi mu' by 13 u,
      so c2 = lr mu' / (1 - Pi') by 22 u; 23 u covers both, the square root 1.
    - ASGD's for-loop step scales the param by ``1 - lambd * eta`` with eta a
      scalar-dtype tensor: compiled, the factor itself is rounded to the
      scalar dtype (eager: a double), ``2 u |prev|`` more (its rounding and
      lambd's, lambd * eta <= 0.5). This is as coarse as a float32 step: the
      decay term lambd * eta * |p| is only checked to u / (lambd * eta) of
      itself; the foreach step multiplies by the eta tensor and matches eager.
    Why none hides a bug: each is the rounding of a scalar the compiled step
    computes in the scalar dtype, times the magnitude it multiplies; a wrong
    step count, a wrong or missing term changes the param by far more (a bias
    correction one step off: tens of percent of the update; float32 u is 6e-8).
    Adamax corrects beta1 only (its beta2 scales exp_inf, a double both ways);
    a param the step skips (no grad) gets nothing."""
    if grad is None:
        return torch.zeros_like(update)
    u = UNIT_ROUNDOFF[tol.get("scalar_dtype") or "float64"]
    group = group or {}
    betas = tuple(group.get("betas", ()))
    if optim == "Adamax":
        betas = betas[:1]
    if optim == "NAdam" and state and "mu_product" in state and len(betas) == 2:
        terms = _nadam_terms(group, prev, grad, state)
        b2 = betas[1]
        rel_b2 = 3 * b2 / (1 - b2) + 1 if 0 < b2 < 1 else 0
        return (rel_b2 + NADAM_COEF_ULPS + 1) * u * terms
    scaled = update
    wd = group.get("weight_decay", 0)
    if group.get("decoupled_weight_decay") and wd and prev is not None:
        # p (1 - lr wd) + T: the decay is a double both ways, only T carries the
        # scalar factors, and where the two cancel |update| is no measure of |T|
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        scaled = update + lr * wd * prev.detach().abs().to(update.device, update.dtype)
    out = compiled_update_rel(betas, u) * scaled
    if optim == "ASGD" and not group.get("foreach") and prev is not None:
        out = out + 2 * u * prev.detach().abs().to(out.device, out.dtype)
    return out


def compiled_state_allowance(optim: str, group: dict | None, key: str, param_allowance):
    """A state tensor that a compiled step derives from the new param: ASGD's
    average ax + mu (p - ax), mu <= 1, inherits at most the param's allowance
    (``compiled_step_allowance``); None for every other state."""
    if optim == "ASGD" and key == "ax" and not (group or {}).get("foreach"):
        return param_allowance
    return None


def _nadam_terms(group: dict, prev, grad, state: dict):
    """|T1| + |T2| of NAdam's step (torch/optim/nadam.py), in float64 from the
    state after it: m = exp_avg, v = exp_avg_sq, Pi = mu_product, t = step."""
    f = lambda x: float(x.item()) if isinstance(x, torch.Tensor) else float(x)  # noqa: E731
    lr, (b1, b2), eps = f(group["lr"]), (f(b) for b in group["betas"]), f(group["eps"])
    psi, wd = f(group["momentum_decay"]), f(group.get("weight_decay", 0.0))
    t, pi = f(state["step"]), f(state["mu_product"])
    g = grad.detach().double()
    if group.get("maximize"):
        g = -g
    if wd and not group.get("decoupled_weight_decay"):
        g = g + wd * prev.detach().double().to(g.device)
    mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    d = (state["exp_avg_sq"].detach().double() / (1 - b2 ** t)).sqrt() + eps
    t1 = lr * (1 - mu) / (1 - pi) * g.abs() / d
    t2 = lr * mu_next / (1 - pi * mu_next) * state["exp_avg"].detach().double().abs() / d
    return t1 + t2


def compiled_scalar_state_tolerance(tol: dict) -> dict:
    """``tol`` for a scalar state (``SCALAR_STATE``: step, ASGD's eta and mu,
    NAdam's mu_product) after a compiled step: it computes them from ``step``
    in the scalar dtype (eta = lr / (1 + lambd lr t)^alpha: about 10 roundings;
    mu_product * mu: 8) where eager rounds a double once, so they are held to
    16 ulps of the scalar dtype, the same whatever their storage dtype (a
    loaded checkpoint stores them in the param's). A step count one off still
    fails (16 ulps of float32 of t <= 3 is 3e-6); eta one step off differs by
    alpha lambd lr / (1 + lambd lr t) of itself, caught where that is above
    16 u (lambd lr >= 1e-5 in float32)."""
    u = max(tol["u"], UNIT_ROUNDOFF[tol.get("scalar_dtype") or "float64"])
    return {**tol, "u": u, "why": tol["why"] + f"; a scalar state: {tol['k_ulps']} ulps of {tol.get('scalar_dtype')}"}


def reduction_tolerance(dtype: str, n: int) -> dict:
    k = 2 * n
    return {
        "k_ulps": k,
        "u": UNIT_ROUNDOFF[dtype],
        "why": f"reordered reductions of length <= {n} on both sides: 2*{n} ulps of {dtype}",
    }


def mixed_precision_tolerance(compute: str, reduce: str, world: int, microbatches: int = 1) -> dict:
    """fsdp2 mixed precision: W per-rank grads computed in ``compute``, each the
    sum of ``microbatches`` grads accumulated in ``reduce`` (m-1 roundings),
    summed in ``reduce`` with a pre- and a post-divide and cast back (W+2
    roundings); both sides, so 2(W+1) + 2(m-1) ulps of ``reduce`` (applied to
    sum|microbatch grads|/W by the caller, plus the same k times the one-ulp
    sensitivity in ``compute``)."""
    k = 2 * (world + 1) + 2 * (microbatches - 1)
    acc = f", each the sum of {microbatches} microbatch grads added in {reduce}" if microbatches > 1 else ""
    eta = max(UNDERFLOW[compute], UNDERFLOW[reduce])
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[reduce], "eta": eta,
            "why": f"mixed precision: per-rank grads in {compute}{acc}, averaged over {world} ranks in {reduce}: "
                   f"{k} ulps of {reduce} of sum|grads|/W, plus {k} x the one-ulp sensitivity in {compute}, "
                   f"plus {k} x {eta:.2g} (a rounding that underflows: half the subnormal spacing)"}


def compare(quantity: str, step: int, fqn: str, got, want, tol: dict, sens: float = 0.0, extra=None) -> dict | None:
    """None when ``got`` matches ``want`` within ``tol``, else a mismatch record.
    ``atol = k*u*max|want| + k*(sens + eta)``, ``eta`` the error of a rounding
    that underflows (``tol``'s, where it counts: float16), ``sens`` being the measured change of
    this tensor under one-ulp nudges of every input (0 for the step oracle);
    ``extra`` is an elementwise allowance (a Partial grad's reduction error)."""
    if got is None or want is None:
        if got is None and want is None:
            return None
        return _mismatch(quantity, step, fqn, tol, detail=f"sharded has {_desc(got)}, reference has {_desc(want)}",
                         presence="appeared" if want is None else "vanished")
    if tuple(got.shape) != tuple(want.shape):
        return _mismatch(
            quantity, step, fqn, tol, detail=f"shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
        )
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.numel() == 0:
        return None
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return _mismatch(quantity, step, fqn, tol, detail="NaN in one run only")
    g, w = g.masked_fill(nan_g, 0), w.masked_fill(nan_w, 0)
    inf = torch.isinf(g) | torch.isinf(w)
    if inf.any() and not torch.equal(g[inf], w[inf]):
        return _mismatch(quantity, step, fqn, tol, detail="inf in one run only")
    g, w = g.masked_fill(inf, 0), w.masked_fill(inf, 0)
    k_u = tol["k_ulps"] * tol["u"]
    atol = k_u * w.abs().max().item() + tol["k_ulps"] * (sens + tol.get("eta", 0.0))
    err = (g - w).abs()
    bound = atol + k_u * w.abs()
    if extra is not None:
        bound = bound + extra.detach().to("cpu", torch.float64).nan_to_num(posinf=float("inf"))
    bad = err > bound
    if not bad.any():
        return None
    flat = int(torch.argmax(torch.where(bad, err - bound, torch.zeros_like(err))).item())
    idx = list(torch.unravel_index(torch.tensor(flat), tuple(w.shape))) if w.dim() else []
    at = tuple(int(i) for i in idx)
    e, ref = err.reshape(-1)[flat].item(), w.reshape(-1)[flat].item()
    return _mismatch(
        quantity,
        step,
        fqn,
        tol,
        max_abs=err.max().item(),
        max_rel=(err / w.abs().clamp_min(1e-300)).max().item(),
        at=at,
        got=g.reshape(-1)[flat].item(),
        want=ref,
        allowed=atol + k_u * abs(ref),
        bad=int(bad.sum().item()),
        numel=w.numel(),
        detail=f"|{e:.3g}| > {atol + k_u * abs(ref):.3g} at {at}",
    )


def compare_hparams(step: int, got: list[dict], want: list[dict]) -> dict | None:
    """Param-group hyperparameters must be equal exactly (they are not computed)."""
    if len(got) != len(want):
        return _mismatch("param_groups", step, "", None, detail=f"{len(got)} groups vs {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        for key in sorted(set(g) | set(w)):
            if not _same(g.get(key), w.get(key)):
                return _mismatch(
                    f"param_groups.{key}", step, f"group {i}", None, detail=f"{g.get(key)!r} vs reference {w.get(key)!r}"
                )
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _desc(t) -> str:
    return "none" if t is None else f"a tensor of shape {tuple(t.shape)}"


def _mismatch(quantity, step, fqn, tol, detail: str, **fields) -> dict:
    tolerance = {"tolerance": tol["why"]} if tol is not None else {}
    return Mismatch(quantity, fqn, step, detail, extra={**tolerance, **fields}).to_dict()


# The replica oracle (kernel/gather.py's replica_mismatches): every rank's copy
# of a replicated value against the lowest rank's. Bit for bit: the ranks hold
# the result of one collective (an all-reduce, a broadcast, an all-gather gives
# every rank the same bits), or of the same deterministic op on the same inputs
# (an optimizer step on replicas of the same params, grads and state; a
# replicated module's backward, on CPU, where every worker runs one thread).
REPLICA_EXACT = {"k_ulps": 0, "u": 0.0,
                 "why": "replicas: bit for bit (a collective gives every rank the same bits, and the same "
                        "deterministic op on the same inputs the same result)"}


def compare_replicas(quantity: str, step: int, fqn: str, copies: dict, tol: dict = REPLICA_EXACT) -> dict | None:
    """None when every rank's copy in ``copies`` ({rank: tensor, None or a
    hyperparameter}) equals the lowest rank's, else one mismatch: the worst
    rank's comparison (``compare``'s numbers, got = that rank's copy, want =
    the lowest rank's), every rank that differs (``ranks``) and the ranks that
    hold each distinct copy (``replicas``). NaN equals NaN; -0.0 equals 0.0."""
    ranks = sorted(copies)
    base = ranks[0]
    want = copies[base]
    worst, worst_rank, differ = None, None, []
    for r in ranks[1:]:
        got = copies[r]
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor) or want is None or got is None:
            m = compare(quantity, step, fqn, got, want, tol)
        else:
            m = None if _same(got, want) else _mismatch(quantity, step, fqn, tol, detail=f"{got!r} vs {want!r}")
        if m is None:
            continue
        differ.append(r)
        size = lambda x: x.get("max_abs", math.inf)  # noqa: E731 (a presence, shape or value: the most telling)
        if worst is None or size(m) > size(worst):
            worst, worst_rank = m, r
    if worst is None:
        return None
    classes: list[list[int]] = []  # ranks holding one copy each, the lowest rank's first
    for r in ranks:
        for cls in classes:
            if _same_copy(copies[cls[0]], copies[r]):
                cls.append(r)
                break
        else:
            classes.append([r])
    worst["detail"] = f"rank {worst_rank}'s copy vs rank {base}'s: {worst['detail']}"
    worst.update(rank=worst_rank, base_rank=base, ranks=differ, replicas=classes)
    return worst


def _same_copy(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return compare("", 0, "", a, b, REPLICA_EXACT) is None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return _same(a, b)
