"""Target ``dtensor``: params as DTensors + a plain torch.optim optimizer.

Every param is replaced by ``distribute_tensor(p, mesh, placements)`` with the
placements the Case draws per param (Shard(d) / Replicate per mesh dim);
buffers and inputs are replicated, so the forward and backward run through
DTensor's sharding propagation and the optimizer steps on local shards.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from ..gather import full_batched
from ..model import loss_fn, named_params, tie_uses
from ..state_io import STATE_DICT_KINDS
from ..ac import AC_HOWS, apply_ac
from .base import Spec, Target


def draw_placements(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **_) -> dict:
    """Per param, per mesh dim, Replicate or Shard(d) on any of its dims."""
    import hypothesis.strategies as st

    out = {}
    for name, shape in shapes.items():
        choices = ["R"] + [f"S{d}" for d in range(len(shape))]
        out[name] = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    return {"placements": out}


def fit_placements(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """One placement per mesh dim: cut, or Replicate on a dim added."""
    if "placements" in options:
        options["placements"] = {n: (p + ["R"] * len(mesh_shape))[:len(mesh_shape)]
                                 for n, p in options["placements"].items()}
    return options


def project_placements(options: dict, kept: tuple) -> dict:
    """Each param's placements on the ``kept`` mesh dims only (Spec.project_options)."""
    if options.get("placements"):
        options["placements"] = {n: [p[d] for d in kept] for n, p in options["placements"].items()}
    return options


def parse_placement(text: str):
    """"R" -> Replicate(), "S1" -> Shard(1)."""
    return Replicate() if text == "R" else Shard(int(text[1:]))


def distribute_params(model: nn.Module, mesh, placements: dict) -> list[nn.Module]:
    """Every plain param a DTensor, placed as ``placements`` says ({fqn: ["R" | "S<d>"] per mesh dim},
    Replicate where it says nothing); a tied param is distributed once and shared again; a param already a
    DTensor stays. Returns the modules that held a plain param of their own."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    done: dict[int, nn.Parameter] = {}
    held = []
    for module in model.modules():
        plain = [(name, p) for name, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name, p in plain:
            if id(p) not in done:
                spec = placements.get(canonical[id(p)], ["R"] * mesh.ndim)
                dt = distribute_tensor(p.detach(), mesh, [parse_placement(s) for s in spec])
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            module.register_parameter(name, done[id(p)])
        if plain:
            held.append(module)
    return held


def dtensor_tie(case) -> str:
    """One DTensor shared by both modules, placed as drawn for its owner's FQN."""
    uses = tie_uses(case.model)
    if not uses:
        return ""
    spec = case.target_options.get("placements", {}).get(uses[0] + ".weight", ["R"] * len(case.mesh_shape))
    return f"one DTensor, placements {'/'.join(spec)}"


def dtensor_facts(case) -> dict:
    """``conv_sharded``: a Conv1d's weight or bias placed other than Replicate (on either side of a checkpoint).
    DTensor's convolution handler runs the local conv on the un-redistributed shards and labels the result
    with the propagated spec (known root cause dtensor-conv-handlers-skip-redistribution): its local shape
    disagrees with the spec, so its next collective gathers mismatched sizes (gloo aborts: SIGABRT)."""
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    return {"conv_sharded": any(n.endswith((".conv.weight", ".conv.bias")) and any(s != "R" for s in spec)
                                for options in sides for n, spec in options.get("placements", {}).items())}


def placements_layout(mesh_shape, options: dict, names) -> dict:
    """Each param's placements: the drawn ones, Replicate where none is drawn (Spec.layout)."""
    return {n: list(options.get("placements", {}).get(n, ["R"] * len(mesh_shape))) for n in names}


def placements_options(layout: dict) -> dict:
    """The options that place every param as ``layout`` says (Spec.place_as)."""
    return {"placements": layout}


# MoE layers only with --models moe (Spec.moe "odds" 0; MOE_ODDS = 8 elsewhere). Here the MoE runs on full copies
# of its params (MoE._forward_local: a full_tensor of each per forward, its grad back through it): a case with one
# costs ~2.8x one without, restarts the pool ~4x as often, and most hit a known DTensor bug first
# (dtensor-grad-placement-differs-from-param, dtensor-missing-strategy-optimizer-ops on its extra params): at one
# in 8 it took about a quarter of a session's time, and any draw of it moves every later byte of a seed's cases
# (docs/search.md). MoE's home is ep, fsdp2, fsdp1, ddp and pp, which draw it by default.
MOE_ODDS = 0


class DTensorTarget(Target):
    name = "dtensor"
    spec = Spec(moe={"whole_batch": True, "local": True, "odds": MOE_ODDS}, options=draw_placements, checkpoint_kinds=STATE_DICT_KINDS, named_params=True, fit_options=fit_placements,
                project_options=project_placements,
                component="DTensor", clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True,
                layout=placements_layout, place_as=placements_options, ac=tuple(AC_HOWS), dropout="replica",
                tie=dtensor_tie, facts=dtensor_facts)
    local_replicas = True  # a Replicate param's grad: each rank's own backward on replicated activations

    def shard(self, model: nn.Module) -> nn.Module:
        distribute_params(model, self.mesh, self.case.target_options.get("placements", {}))
        apply_ac(model, self.case.target_options)  # activation checkpointing over the DTensor params (kernel/ac.py)
        for module in model.modules():
            for name, b in list(module.named_buffers(recurse=False)):  # a non-persistent one stays so (an MoE's counts)
                module.register_buffer(name, self._replicate(b),
                                       persistent=name not in module._non_persistent_buffers_set)
        return model

    def _replicate(self, t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, self.mesh, [Replicate()] * self.mesh.ndim)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        """Every rank sees the whole global batch, replicated. A plugin's model
        may make plain tensors in its forward (positions, masks): they count as
        replicated, as a user running it on DTensors would say with
        ``implicit_replication``."""
        with implicit_replication() if self.case.model.factory else contextlib.nullcontext():
            out = model(self._replicate(x))
        loss = loss_fn(out, self._replicate(y))
        return loss, loss.full_tensor()

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return full_batched(t, DTensor.full_tensor) if isinstance(t, DTensor) else t

    def grad_spreads(self, model: nn.Module) -> dict:
        out = {}
        for n, p in named_params(model).items():  # (plain FQNs, as grads(): an AC wrapper may sit in between)
            s = self._grad_spread(p.grad) if p.grad is not None else None
            if s is not None:
                out[n] = s
        return out

    def _grad_spread(self, g: torch.Tensor):
        """(sum of |partials|, number of partials) for a grad that is Partial on
        some mesh dims, else None. The optimizer's ops may each reduce such a
        grad in their own order, not the order full_tensor() used."""
        if not isinstance(g, DTensor) or not any(pl.is_partial() for pl in g.placements):
            return None
        n = 1
        for dim, pl in enumerate(g.placements):
            if pl.is_partial():
                n *= g.device_mesh.size(dim)
        abs_partials = DTensor.from_local(g.to_local().abs(), g.device_mesh, g.placements, shape=g.shape,
                                          stride=g.stride(), run_check=False)
        return abs_partials.full_tensor(), n
