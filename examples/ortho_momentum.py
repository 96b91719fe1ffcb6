"""A user's own sharded optimizer, fuzzed from this one file:

    fuzzshard fuzz --plugin examples/ortho_momentum.py --optimizers OrthoMomentum --target dtensor,fsdp2

OrthoMomentum is Muon-style: heavy-ball momentum, then for a matrix param the
update orthogonalized by a Newton-Schulz iteration on the *full* matrix (a
sharded param gathers its momentum with ``full_tensor()``, orthogonalizes it
and keeps its own shard), plain momentum for the other params. It takes
DTensor params (dtensor, fsdp2) and plain ones (the unsharded reference).

ORTHO_MOMENTUM_BUG=local_shard plants the classic bug: orthogonalizing each
rank's local shard instead of the full matrix. fuzzshard finds it, shrinks it
to two ranks and one Linear, and the repro replays it:

    ORTHO_MOMENTUM_BUG=local_shard fuzzshard fuzz --plugin examples/ortho_momentum.py \\
        --optimizers OrthoMomentum --target dtensor --world-sizes 1,2 --checkpoints none --seed 0
"""
import os

import hypothesis.strategies as st
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from fuzzshard import plugin

PLANTED = os.environ.get("ORTHO_MOMENTUM_BUG") == "local_shard"


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration Muon uses: g's nearest
    semi-orthogonal matrix, approximately (in g's dtype)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def orthogonalized(m: torch.Tensor, steps: int) -> torch.Tensor:
    if not isinstance(m, DTensor):
        return newton_schulz(m, steps)
    if PLANTED:  # the bug: each rank orthogonalizes its own block
        return DTensor.from_local(newton_schulz(m.to_local(), steps), m.device_mesh, m.placements,
                                  shape=m.shape, stride=m.stride())
    full = newton_schulz(m.full_tensor(), steps)  # every rank computes the same full matrix ...
    return distribute_tensor(full, m.device_mesh, m.placements, src_data_rank=None)  # ... and keeps its shard


class OrthoMomentum(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if isinstance(p, DTensor) and g.placements != p.placements:  # e.g. a Partial grad
                    g = g.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(g)
                update = orthogonalized(buf, group["ns_steps"]) if p.ndim == 2 else buf
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss


plugin.optimizer(OrthoMomentum, elementwise=False, kwargs=st.fixed_dictionaries({
    "lr": st.sampled_from([0.02, 0.005]),
    "momentum": st.sampled_from([0.0, 0.9, 0.95]),
    "ns_steps": st.integers(1, 5),
    "weight_decay": st.sampled_from([0.0, 0.01]),
}))
