"""The unsharded model and optimizer of a case, as the oracles use them: built
the same way the sharded run builds its own, stepped through the case's
schedule (freezes, late param groups, the target options each step ran with),
anchored on a sharded run's recorded state, and probed for how far one ulp of
rounding moves a result. The reference replay (reference.py), the checkpoint
oracles (checkpoint.py) and a target's own reference hooks (base.Target) all
start from here.
"""
from __future__ import annotations

import torch

from ..case import Case
from .model import build_model
from .optim import add_late_groups, adds_groups_before, build_optimizer, load_state_by_fqn


def torch_dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)


def setup(case: Case, device: str):
    """(model, optimizer), unsharded, with the case's initially frozen params."""
    model = build_model(case.model, case.seed, device, torch_dtype(case))
    for n in case.frozen:
        model.get_parameter(n).requires_grad_(False)
    return model, build_optimizer(model, case)


def before_step(model, opt, case: Case, k: int) -> None:
    """A step's freezes and unfreezes, and the groups the case adds before it."""
    apply_flags(model, case.schedule[k])
    if adds_groups_before(case, k):
        add_late_groups(opt, model, case)


def apply_flags(model, step) -> None:
    for n in step.freeze:
        model.get_parameter(n).requires_grad_(False)
    for n in step.unfreeze:
        model.get_parameter(n).requires_grad_(True)


def options_at(case: Case, k: int) -> tuple[dict, int]:
    """The target options and world size step k ran with (the loading side's after a checkpoint)."""
    ck = case.checkpoint
    return (ck.target_options, ck.world_size) if ck and k > ck.after else (case.target_options, case.world_size)


def anchor(model, opt, case: Case, rec: dict) -> None:
    """Make the reference exactly the sharded run's state after the previous
    step. The grads too: zero_grad clears only the optimizer's params, so the
    grad of a param in no group yet (added mid-run) accumulates over steps."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec["params"][n])
            g = rec["grads"][n]
            p.grad = None if g is None else g.to(p.device).clone()
    load_state_by_fqn(opt, model, rec["state"])


SENSITIVITY_DRAWS = 4


def sensitivity(model, params: dict, x, y, objective, scale: float = 1.0) -> dict[str, float]:
    """How far one ulp moves each result: rerun forward/backward with every
    param and float input nudged by one ulp (random direction, fixed seed),
    and take the largest change per tensor. Rounding anywhere in a legitimate
    run acts like such nudges, so k times this bounds it even where a result
    cancels to ~0 (e.g. through a LayerNorm over a near-constant row).
    ``objective(model, x, y)``: the loss (the target's, under the step's options)."""
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
        loss = objective(model, xin, y) * scale
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
