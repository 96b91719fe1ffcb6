"""Run one Case: the sharded training on every rank, then the reference check.

The sharded run records, after every step, the full (gathered) loss, grads,
params, optimizer state and param-group hyperparameters. The reporting rank
then replays the reference *anchored*: before step k it loads the sharded
run's params and state after step k-1, so float noise never compounds over
steps and every divergence is caught at the step that made it:
  - loss and grads of step k vs the reference forward/backward on the same
    params and data (reduction tolerance);
  - params, state and hyperparameters after step k vs the reference
    optimizer stepping from the same params, state *and grads* (step tolerance).
A verdict is a plain dict: status pass | invalid | finding.
"""
from __future__ import annotations

import time

from ..case import Case
from .localize import Trace
from .model import build_model, make_batch
from .optim import build_optimizer, group_hparams, state_by_fqn
from .reference import _apply_flags, _exc, _plain_reference_error, _plain_setup, check_parity, torch_dtype


def run_case(case: Case, mesh, target_cls, device: str, reporter: bool, timings: dict | None = None,
             localize: bool = False) -> dict | None:
    """Every rank of the case's mesh calls this; only the reporter returns a verdict
    unless the sharded run raised here (then this rank returns the error verdict)."""
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    try:
        _plain_setup(case, device)
    except Exception as e:  # the reference itself rejects the config
        return {"status": "invalid", "reason": f"reference rejects the config: {_exc(e)['text']}"}
    obs, error = _run_sharded(case, mesh, target_cls, device, keep=reporter, localize=localize)
    t1 = timings["sharded"] = time.perf_counter() - t0
    if error is not None:
        ref_error = _plain_reference_error(case, device)
        if ref_error is not None:
            return {"status": "invalid", "reason": f"reference raises too: {ref_error['text']}", "error": error}
        return {"status": "finding", "oracle": "error_parity", "error": error}
    if not reporter:
        return None
    verdict = check_parity(case, obs, device, localize=localize)
    timings["reference"] = time.perf_counter() - t0 - t1
    return verdict


def _run_sharded(case: Case, mesh, target_cls, device: str, keep: bool, localize: bool = False):
    """(observations, None) or (None, error record). Collectives need every rank
    to gather in the same order, so all ranks gather and only ``keep`` stores."""
    dtype = torch_dtype(case)
    phase = "shard"
    try:
        target = target_cls(case, mesh)
        model = build_model(case.model, case.seed, device, dtype)
        init = {n: p.detach().clone() for n, p in model.named_parameters()} if keep else None
        model = target.shard(model)
        trace = Trace(model, getattr(target, "full_activation", target.full),
                      getattr(target, "full_activation_grad", target.full)) if localize else None
        for n in case.frozen:
            model.get_parameter(n).requires_grad_(False)
        phase = "optimizer constructor"
        opt = build_optimizer(model, case)
        phase = "gather initial optimizer state"
        init_state = state_by_fqn(opt, model, target.full)  # some optimizers fill state in __init__
        steps = []
        for k, step in enumerate(case.schedule):
            _apply_flags(model, step)
            phase = f"step {k}: zero_grad"
            opt.zero_grad(set_to_none=step.set_to_none)
            phase = f"step {k}: forward/backward"
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            loss, full_loss = target.loss(model, x, y)
            loss.backward()
            traced = trace.take() if trace else None
            phase = f"step {k}: gather grads"
            grads = {n: None if p.grad is None else target.full(p.grad).detach().clone() for n, p in model.named_parameters()}
            spread = {}
            for n, p in model.named_parameters():
                s = target.grad_spread(p.grad) if p.grad is not None and hasattr(target, "grad_spread") else None
                if s is not None:
                    spread[n] = s
            phase = f"step {k}: optimizer.step"
            opt.step()
            phase = f"step {k}: gather params and state"
            rec = {
                "loss": full_loss.detach().clone(),
                "grads": grads,
                "grad_spread": spread,
                "params": {n: target.full(p).detach().clone() for n, p in model.named_parameters()},
                "state": state_by_fqn(opt, model, target.full),
                "groups": group_hparams(opt),
                "trace": traced,
            }
            if keep:
                steps.append(rec)
        return ({"init": init, "init_state": init_state, "steps": steps} if keep else None), None
    except Exception as e:
        return None, {**_exc(e), "phase": phase}
