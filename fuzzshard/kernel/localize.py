"""Name the module behind a loss or grad divergence."""
from __future__ import annotations

import torch

from .model import plain_fqn
from .oracles import compare


class Trace:
    """Records each traced module's output (forward order) and the grad of
    that output (backward order), as full tensors. Used only to name the first
    diverging module once a loss or grad divergence is known: it decides no
    verdict, so its tolerance cannot cause a false positive.

    ``points``: which modules, by plain FQN (Target.trace_points); None: every
    leaf. ``full(t, fqn)`` / ``full_grad(g, fqn)``: the whole-batch plain
    tensor of a module's output or its grad, as the reference has it."""

    def __init__(self, model, full, full_grad, points=None):
        self.full, self.full_grad, self.fwd, self.bwd, self.handles = full, full_grad, [], [], []
        seen = set()
        for name, mod in model.named_modules():
            fqn = plain_fqn(name)
            if not name or fqn in seen or not (points(fqn) if points else not list(mod.children())):
                continue
            seen.add(fqn)  # a wrapper and the module it wraps share a plain FQN: the outer one is traced
            kind = type(mod).__name__
            kind = kind[4:] if kind.startswith("FSDP") else kind  # fully_shard renames the class
            kind = type(getattr(mod, "_checkpoint_wrapped_module", mod)).__name__ if kind == "CheckpointWrapper" else kind
            self.handles.append(mod.register_forward_hook(self._hook(fqn, kind)))

    def _hook(self, name, kind):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                self.fwd.append((name, kind, self.full(out, name).detach().clone()))
                if out.requires_grad:
                    out.register_hook(lambda g: self.bwd.append((name, kind, self.full_grad(g, name).detach().clone())))

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
