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
import traceback

import torch

from ..case import Case
from .model import build_model, loss_fn, make_batch
from .optim import build_optimizer, group_hparams, load_state_by_fqn, state_by_fqn
from .oracles import UNIT_ROUNDOFF, compare, compare_hparams, reduction_tolerance, step_tolerance

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


def _plain_setup(case: Case, device: str):
    model = build_model(case.model, case.seed, device, torch_dtype(case))
    for n in case.frozen:
        model.get_parameter(n).requires_grad_(False)
    return model, build_optimizer(model, case)


def _apply_flags(model, step) -> None:
    for n in step.freeze:
        model.get_parameter(n).requires_grad_(False)
    for n in step.unfreeze:
        model.get_parameter(n).requires_grad_(True)


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


def _plain_reference_error(case: Case, device: str) -> dict | None:
    """Run the plain reference schedule un-anchored; its exception, if any."""
    try:
        model, opt = _plain_setup(case, device)
        for k, step in enumerate(case.schedule):
            _apply_flags(model, step)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, torch_dtype(case))
            loss_fn(model(x), y).backward()
            opt.step()
    except Exception as e:
        return _exc(e)
    return None


def reduction_length(case: Case) -> int:
    """Longest chain of summed terms behind a loss or grad element (see oracles)."""
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


def check_parity(case: Case, obs: dict, device: str, localize: bool = False) -> dict:
    dtype = torch_dtype(case)
    try:
        model, opt = _plain_setup(case, device)
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
        try:
            _anchor(model, opt, case, prev)
            _apply_flags(model, step)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            sens = _sensitivity(model, params, x, y)
            trace = Trace(model, lambda t: t, lambda t: t) if localize and rec["trace"] else None
            loss = loss_fn(model(x), y)
            loss.backward()
            here = [compare("loss", k, "", rec["loss"], loss.detach(), red_tol, sens=sens["loss"])]
            here += [compare("grad", k, n, rec["grads"][n], p.grad, red_tol, sens=sens.get(n, 0.0)) for n, p in params.items()]
            here = [m for m in here if m]
            if trace:  # name the module behind this step's divergence, if it has one
                culprit = localize_divergence(rec["trace"], trace.take(), red_tol) if here else None
                trace.remove()
                if culprit:
                    culprit["step"] = k
                    return _finding([m for m in mismatches if m] + [culprit] + here)
            mismatches += here
            with torch.no_grad():  # step from the sharded grads: isolates the optimizer
                for n, p in params.items():
                    g = rec["grads"][n]
                    p.grad = None if g is None else g.to(p.device).clone()
            opt.step()
        except Exception as e:
            ref_error = _plain_reference_error(case, device)
            if ref_error is not None:
                return {"status": "invalid", "reason": f"reference raises: {ref_error['text']}"}
            return _finding([m for m in mismatches if m] + [{"quantity": "reference replay", "step": k, "fqn": "", "detail": f"the reference could not replay the sharded state: {_exc(e)['text']}"}])
        rel = _grad_uncertainty(case, rec)
        for n, p in params.items():
            extra = None if n not in rel else PARTIAL_GRAD_READS * rel[n] * (p.detach() - prev["params"][n].to(p.device)).abs()
            mismatches.append(compare("param", k, n, rec["params"][n], p.detach(), step_tol, extra=extra))
        mismatches += _compare_state(k, rec["state"], state_by_fqn(opt, model, lambda t: t), step_tol, rel)
        mismatches.append(compare_hparams(k, rec["groups"], group_hparams(opt)))
        prev = rec
    mismatches = [m for m in mismatches if m]
    if mismatches:
        return _finding(mismatches)
    return {"status": "pass"}


class Trace:
    """Records each leaf module's output (forward order) and the grad of that
    output (backward order), as full tensors. Used only to name the first
    diverging module once a loss or grad divergence is known: it decides no
    verdict, so its tolerance cannot cause a false positive."""

    def __init__(self, model, full, full_grad):
        self.full, self.full_grad, self.fwd, self.bwd, self.handles = full, full_grad, [], [], []
        for name, mod in model.named_modules():
            if not list(mod.children()) and name:
                kind = type(mod).__name__
                kind = kind[4:] if kind.startswith("FSDP") else kind  # fully_shard renames the class
                self.handles.append(mod.register_forward_hook(self._hook(name, kind)))

    def _hook(self, name, kind):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                self.fwd.append((name, kind, self.full(out).detach().clone()))
                if out.requires_grad:
                    out.register_hook(lambda g: self.bwd.append((name, kind, self.full_grad(g).detach().clone())))

        return hook

    def take(self):
        out, self.fwd, self.bwd = {"fwd": self.fwd, "bwd": self.bwd}, [], []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def localize_divergence(got: dict, want: dict, tol: dict) -> dict | None:
    """The first module whose output diverges (forward order), else the first
    whose output grad diverges (backward order): the module that consumed it
    computed a wrong input grad."""
    for phase in ("fwd", "bwd"):
        for (name, kind, g), (wname, _, w) in zip(got[phase], want[phase]):
            if name != wname:
                break  # the call orders differ: cannot localise further
            m = compare("forward" if phase == "fwd" else "backward", -1, name, g, w, tol)
            if m:
                m["module"] = kind
                m["detail"] = f"{'output' if phase == 'fwd' else 'output grad'} of {name} ({kind}): {m['detail']}"
                return m
    return None


SENSITIVITY_DRAWS = 4


def _sensitivity(model, params: dict, x, y) -> dict[str, float]:
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
        loss = loss_fn(model(xin), y)
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
    """Make the reference exactly the sharded run's state after the previous step."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec["params"][n])
            p.grad = None if rec["grads"][n] is None else torch.zeros_like(p)
    load_state_by_fqn(opt, model, rec["state"])


def _finding(mismatches: list[dict]) -> dict:
    return {
        "status": "finding",
        "oracle": "parity",
        "first": mismatches[0],
        "mismatches": mismatches[:MAX_REPORTED],
        "count": len(mismatches),
    }


def _exc(e: BaseException) -> dict:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {
        "type": type(e).__name__,
        "message": msg[:500],
        "text": f"{type(e).__name__}: {msg[:300]}",
        "traceback": "".join(traceback.format_exception(e))[-4000:],
    }
