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
STEP_ULPS = 16


def step_tolerance(dtype: str, reduce_len: int = 1) -> dict:
    k = STEP_ULPS * reduce_len
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[dtype], "why": f"same inputs, elementwise rounding: {k} ulps of {dtype}"}


def compiled_step_tolerance(tol: dict, dtype: str, betas) -> dict:
    """``tol`` for an optimizer step run under torch.compile. Eager evaluates a
    step's scalar factors (Adam's bias corrections 1 - beta^t, their square
    roots, lr / correction) as Python doubles; compiled, they are ``dtype``
    tensors: beta rounds to ``dtype`` (u), its t-th power errs by t u more
    (plus u), and 1 - beta^t cancels, so its relative error is
    ((t + 2) beta^t / (1 - beta^t) + 1) u, largest at t = 1: 3 beta / (1 - beta) + 1
    (beta2 = 0.999: about 3000 u). Each correction enters the update at most
    once; a few more roundings (lr, the product, the square root, eps) add 4 u.
    The param may then differ by that relative error of its update,
    ``update_rel * |update|`` per element, on top of the elementwise bound.
    Not covered: RAdam's rectification, whose rho_t = rho_inf - 2 t beta2^t /
    (1 - beta2^t) cancels far worse; it applies from rho_t > 5 (step 5 or
    later), past the strategies' three steps, and needs its own bound first."""
    u = UNIT_ROUNDOFF[dtype]
    rel = (sum(3 * b / (1 - b) + 1 for b in betas if 0 < b < 1) + 4) * u
    return {**tol, "update_rel": rel,
            "why": tol["why"] + f"; compiled step: + {rel:.3g} x |update| (its scalar factors in {dtype}: "
                                f"1 - beta^t for betas {list(betas)}, at t = 1)"}


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
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[reduce],
            "why": f"mixed precision: per-rank grads in {compute}{acc}, averaged over {world} ranks in {reduce}: "
                   f"{k} ulps of {reduce} of sum|grads|/W, plus {k} x the one-ulp sensitivity in {compute}"}


def compare(quantity: str, step: int, fqn: str, got, want, tol: dict, sens: float = 0.0, extra=None) -> dict | None:
    """None when ``got`` matches ``want`` within ``tol``, else a mismatch record.
    ``atol = k*u*max|want| + k*sens``, ``sens`` being the measured change of
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
    atol = k_u * w.abs().max().item() + tol["k_ulps"] * sens
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
