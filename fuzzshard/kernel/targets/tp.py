"""Target ``tp``: tensor parallelism alone, ``parallelize_module`` + a plain torch.optim optimizer.

The case's TP plan (``tp``: {Linear or Embedding FQN: "colwise" | "rowwise"},
drawn as fsdp2's TP + FSDP2 mode draws it; for the decoder transformer
torchtitan's plan, with ``sp`` and ``loss_parallel``) is applied with
``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D mesh of all the case's
ranks, and nothing else shards: no FSDP. Every param the plan leaves alone is
made a replicated DTensor too (the optimizer's foreach and fused kernels
refuse a mix of DTensors and plain tensors), and the module holding it takes
and gives plain tensors (``distribute_module``'s input and output hooks), so
between modules the activations are plain, as under fsdp2's TP. TP is not
data parallel: every rank trains on the same whole batch, and the grads need
no averaging.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_map_only

from ..decoder import plan_element
from ..float8 import draw_float8_decoder_tp, draw_float8_tp, float8_convert, float8_reference, float8_tp_problem
from ..model import loss_fn, tie_uses
from ..moe import MoE
from ..state_io import STATE_DICT_KINDS
from ..ac import AC_HOWS, apply_ac
from .base import Spec
from .dtensor import DTensorTarget, distribute_params
from ..fsdp2_rules import coverage, draw_decoder_tp, draw_tp_plan, seq_multiple, tp_problem
from .fsdp2 import apply_tp, loss_context


def draw_tp_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """fsdp2's TP plan drawing, over the whole (1-D) mesh: a style per Linear
    and the input Embedding, or for the decoder torchtitan's plan with ``sp``
    and ``loss_parallel``."""
    import hypothesis.strategies as st

    model = context["model"]
    if model.factory == "decoder":
        out = draw(st.composite(draw_decoder_tp)(model.sizes, mesh_shape[-1]))
        if context.get("ao"):  # --ao: torchtitan's float8 TP plan (kernel/float8.py), drawn after the plan
            f8 = draw(st.composite(draw_float8_decoder_tp)(out, shapes))
            if f8:
                out["float8"] = f8
        return out
    out = {"tp": draw(st.composite(draw_tp_plan)(shapes, tied, model))}
    if context.get("ao"):  # --ao: torchao's float8 Linears under its float8 TP styles (kernel/float8.py)
        f8 = draw(st.composite(draw_float8_tp)(out["tp"], model, shapes))
        if f8:
            out["float8"] = f8
    return out


def check_tp(case) -> str | None:
    """What a TP plan cannot be (fsdp2.tp_problem), on either side of a checkpoint; 1-D meshes only."""
    sides = [("", case.mesh_shape, case.target_options)]
    if case.checkpoint:
        sides.append(("checkpoint ", case.checkpoint.mesh_shape, case.checkpoint.target_options))
    for what, mesh, options in sides:
        if len(mesh) != 1:
            return f"{what}tp runs on a 1-D mesh of all the ranks, not {list(mesh)}"
        problem = tp_problem(case, mesh, options) or float8_tp_problem(case, options)
        if problem:
            return what + problem
    return None


def _replicated(mod, inputs, mesh):
    """A module the plan leaves whole, its params replicated: its plain tensor inputs as replicated DTensors."""
    return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, DTensor) else
                         DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False), inputs)


def _local(mod, outputs, mesh):
    """... and its outputs plain again (every rank holds the whole of a replicated one)."""
    return tree_map_only(DTensor, lambda t: t.to_local(), outputs)


def tp_tie(case) -> str:
    """A tied decoder's vocabulary-parallel pair (one Shard(0) DTensor), else one replicated DTensor."""
    if not tie_uses(case.model):
        return ""
    plan = case.target_options.get("tp") or {}
    return "vocab-parallel, Shard(0)" if plan.get("tok_embeddings") == "rowwise" else "replicated"


def tp_layout(mesh_shape, options: dict, names) -> dict | None:
    """No plan: every param a replicated DTensor; a plan: no plain layout."""
    return None if options.get("tp") else {n: ["R"] * len(mesh_shape) for n in names}


class TPTarget(DTensorTarget):
    name = "tp"
    # DTensor's and fsdp2's TP known torch bugs are this target's too (findings.is_known), DTensor's first: its
    # params are DTensors stepped by torch.optim, as the dtensor target's are, so a signature both lists hold
    # (a step's refused in-place placement change) is DTensor's root cause. Not fsdp2's facts: its
    # tp_empty_shard trigger names fully_shard's bug with an empty TP shard, which TP alone does not meet
    known_as = ("dtensor", "fsdp2")
    spec = Spec(moe={"whole_batch": True, "local": True}, options=draw_tp_options, checkpoint_kinds=STATE_DICT_KINDS, named_params=True, flat_mesh=True,
                coverage=coverage, check=check_tp, seq_multiple=seq_multiple, component="TP",
                clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True,
                layout=tp_layout, ac=tuple(AC_HOWS), dropout="replica",
                tie=tp_tie)

    @property
    def localizable(self) -> bool:
        """Between modules the activations are whole plain tensors, but under sequence parallelism (each
        rank's part of the sequence)."""
        return not self.case.target_options.get("sp") and not self.case.target_options.get("float8")

    @classmethod
    def trace_points(cls, case):
        """A decoder is traced at its plan's elements, as under fsdp2's TP: inside attention and the MLP a
        colwise Linear's output is this rank's heads or hidden units (a plain local shard, which the
        localizer would take for a wrong whole tensor), at their boundaries whole on every rank."""
        return plan_element if case.model.factory == "decoder" else None

    @classmethod
    def reference_loss_grads(cls, case, model: nn.Module, options: dict, world: int, x, y, scale: float = 1.0):
        """float8 (--ao): the same float8 model unsharded, on the whole batch (TP is not data parallel)."""
        if options.get("float8"):
            return float8_reference(case, model, options, 1, x, y, cls.objective, scale)
        return super().reference_loss_grads(case, model, options, world, x, y, scale)

    def shard(self, model: nn.Module) -> nn.Module:
        if self.case.target_options.get("float8"):  # torchao's float8 Linears first, then the plan (kernel/float8.py)
            float8_convert(model, self.case.target_options["float8"], self.mesh.device_type)
        apply_tp(model, self.mesh, self.case.target_options, self.case.model.factory)
        apply_ac(model, self.case.target_options)  # after the plan (its FQNs name plain modules): kernel/ac.py
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        inside = {id(sub) for m in moes for sub in m.modules()}
        for module in distribute_params(model, self.mesh, {}):  # what the plan left plain: replicated
            if id(module) not in inside:
                distribute_module(module, self.mesh, input_fn=_replicated, output_fn=_local)
        for module in moes:  # an MoE is kept whole, one unit: plain in and out, its params replicated DTensors
            distribute_module(module, self.mesh, input_fn=_replicated, output_fn=_local)
        return model

    def _forward(self):
        """A plugin's model may make plain tensors in its forward (positions, masks): they count as
        replicated, as in the dtensor target."""
        return implicit_replication() if self.case.model.factory not in ("", "decoder") else contextlib.nullcontext()

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        """Every rank sees the whole batch, plain; the loss is a DTensor only under loss_parallel."""
        with self._forward():
            loss = loss_fn(model(x), y)
        return loss, loss.full_tensor() if isinstance(loss, DTensor) else loss

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_context(self.case.target_options):
            loss, full = self.loss(model, x, y)
            self.backward(loss)
        return full.detach()
