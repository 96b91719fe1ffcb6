"""The pp adapter (``PPTarget``): the stages and the schedule on each rank, FSDP2 on [pp, dp].

It cuts the plain model into its stages (stages.py) on the ranks the
schedule puts them (schedules.py), drives the schedule over this rank's
slice of the batch, with FSDP2 on each stage over the dp sub-mesh on a
[pp, dp] mesh, and gathers every rank's own params, grads and optimizer
state to full plain copies for the oracles. Its Spec wires in the draws and
the check (draws.py), the facts and coverage (describe.py); its save and
load come from checkpoint.py.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from ....case import Case
from ...ac import AC_NON_REENTRANT, apply_ac
from ...dropout import draws
from ...model import loss_fn, named_params, param_shapes, submodule, tie_uses
from ...optim import build_optimizer, group_hparams, state_by_fqn
from ..base import Spec, Target
from .checkpoint import CHECKPOINT_KINDS, PipelineCheckpoint
from .describe import coverage_with_checkpoint, facts_with_checkpoint, pp_tie
from .draws import check, draw_late_options_both_sides, draw_options, fit_options
from .schedules import (REFUSALS, accumulate, dropout_index, is_multi, n_units, pp_objective, replayed_stages,
                        schedule_class, stage_layers, stage_ranks, tie_span)
from .stages import _Local, _StageModule, stage_ends


class PPTarget(PipelineCheckpoint, Target):
    name = "pp"
    spec = Spec(moe={"whole_batch": False, "microbatched": True, "aux": False, "bias": False}, options=draw_options, checkpoint_kinds=CHECKPOINT_KINDS, named_params=True,
                late_options=draw_late_options_both_sides, check=check, fit_options=fit_options,
                facts=facts_with_checkpoint, coverage=coverage_with_checkpoint, component="pipelining",
                lr_scheduler=True, lr_scheduler_checkpoint=False, max_depth=8,
                # activation checkpointing inside each stage, non-reentrant only (the zero-bubble schedules'
                # split backward calls torch.autograd.grad, which reentrant checkpoint does not support)
                ac=AC_NON_REENTRANT, tie=pp_tie,
                # each stage rank's masks from its own seed, replayed stage after stage (objective; kernel/dropout.py)
                dropout="replay",
                # a timed session steers [pp, dp] cases toward ``ep`` (an MoE, its experts over dp; no checkpoint),
                # where it bites: 2+ samples a dp rank, so 2+ microbatches can carry them (draws.py, aim)
                corner={"option": "ep", "mesh_dims": 2, "experts_over": 1, "checkpoint": False,
                        "batch": lambda mesh_shape: [k * mesh_shape[1] for k in (2, 3, 4)]})
    localizable = False  # a rank runs only its stages' modules, once per microbatch
    # on a [pp, dp] mesh each stage is FSDP2 over dp (DTensor params): an error FSDP2's or DTensor's code raises with
    # the same message (an error signature hashes it) is their known torch bug, as an Rprop step's in-place
    # index_put_ on a Shard(0) param; pp's parity signatures stay its own (pp.parity.grad is not fsdp2's)
    known_errors_as = ("fsdp2", "dtensor")

    @classmethod
    def objective(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
        """The unsplit model on the schedule's microbatches: the mean of their
        losses with scale_grads (the schedule divides the summed grads by
        their number), else their sum; with ``dp`` and ``accum``, pp_objective."""
        replay = draws()  # dropout: each stage's masks from its rank's seed, stage after stage (kernel/dropout.py)
        return pp_objective(model, x, y, options) if replay is None else replayed_stages(model, x, y, options, replay)

    def dropout_rank(self) -> int:
        """The seed this rank draws its stages' masks from: its own on the [pp] or [pp, dp] mesh (every stage rank
        draws its stage's masks, every dp rank on its slice), ``dropout_index``."""
        dp = self.mesh.size(1) if self.mesh.ndim == 2 else 1
        return dropout_index(self.rank, self.dp_rank(), dp)

    @classmethod
    def documented_refusal(cls, case: Case, error: dict) -> bool:
        """torch refuses the schedule's config by design (REFUSALS): an invalid case."""
        return error.get("type") in ("ValueError", "AssertionError") and any(
            r in error.get("message", "") for r in REFUSALS)

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        # the pipeline's group: the mesh's, or on a [pp, dp] mesh this dp index's pp group
        self.group = mesh.get_group(0) if mesh.ndim == 2 else mesh.get_group()
        self.dp_group = mesh.get_group(1) if mesh.ndim == 2 else None
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        o = case.target_options
        self.layers_of = stage_layers(o, n_units(case.model))
        self.rank_of = stage_ranks(o, case.world_size)
        self.mine = [s for s, r in enumerate(self.rank_of) if r == self.rank]
        self.last_rank = self.rank_of[-1]

    def shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage

        o = self.case.target_options
        apply_ac(model, o)  # before the stages take its layers (kernel/ac.py)
        device = next((p.device for p in model.parameters()), torch.device(self.case.device))
        last = len(self.rank_of) - 1
        scale = getattr(model, "scale", None)
        self.stages = []
        local, ends = {}, {}
        for s in self.mine:
            layers = {str(i): model.layers[str(i) if isinstance(model.layers, nn.ModuleDict) else i]
                      for i in self.layers_of[s]}
            local.update(layers)
            ends.update(stage_ends(model, s, last))
            module = _StageModule(layers, scale if s == last else None, stage_ends(model, s, last))
            if o.get("dp"):
                self._fully_shard(module, self._expert_parallel(module) if o.get("ep") else set())
            self.stages.append(PipelineStage(module, s, len(self.rank_of), device, group=self.group))
        cls = schedule_class(o["schedule"])
        kw = {"n_microbatches": o["n_microbatches"], "loss_fn": loss_fn, "scale_grads": bool(o.get("scale_grads"))}
        self.schedule = cls(self.stages, **kw) if is_multi(o["schedule"]) else cls(self.stages[0], **kw)
        unused = getattr(model, "unused", None) if self.rank == self.last_rank else None
        tie = None
        self.tie_span = tie_span(self.case)
        if self.tie_span == "ranks" and self.rank == self.last_rank:  # the head's weight, as its stage holds it now
            owner, head = tie_uses(self.case.model)
            tie = (owner, self.stages[self.mine.index(last)].submod.get_submodule(head).weight)
        return _Local(local, unused, ends, tie)

    def reduce_tied_grad(self, model: nn.Module) -> None:
        """A tie across ranks: the tied weight's grad summed over the first and the last stage's ranks (each
        holds its use's part), as Megatron-LM's embedding group all-reduces the word embeddings' grads before
        the step. Over the pipeline's group, the ranks between them adding zeros (exact): a group of the two
        ranks alone is what a user makes (the repro script does), which the pool's fixed groups may not hold."""
        from torch.distributed.tensor import DTensor

        if self.tie_span != "ranks":
            return
        owner = tie_uses(self.case.model)[0] + ".weight"
        p = named_params(model).get(owner) if self.rank in (0, self.last_rank) else None
        g = p.grad if p is not None else None
        local = g.to_local() if isinstance(g, DTensor) else g
        buf = local.detach().clone() if local is not None else torch.zeros(self._tied_local_shape(),
                                                                            dtype=getattr(torch, self.case.dtype),
                                                                            device=self.case.device)
        dist.all_reduce(buf, group=self.group)
        if local is not None:
            local.copy_(buf)

    def _tied_local_shape(self) -> tuple:
        """This rank's share of the tied weight: whole, or under FSDP2 its dim-0 chunk over dp (FSDP2's torch.chunk)."""
        shape = param_shapes(self.case.model)[tie_uses(self.case.model)[0] + ".weight"]
        if self.dp_group is None:
            return shape
        chunks = torch.empty(shape, device="meta").chunk(dist.get_world_size(self.dp_group), 0)
        r = dist.get_rank(self.dp_group)
        return tuple(chunks[r].shape) if r < len(chunks) else (0, *shape[1:])

    def _expert_parallel(self, module: nn.Module) -> set:
        """``ep``: every MoE's routed experts of this stage Shard(0) over the dp sub-mesh, their tokens dispatched
        and combined with all-to-all over it (ep's ``ExpertParallel``, torchtitan's EP borrowing the dp ranks).
        The combine's backward sums an expert's grad over the dp ranks' tokens; a hook divides it by dp (the
        reference's mean over the dp slices), as ep's 1-D mesh does (``_divided``). Returns the experts' params:
        FSDP2 leaves them out (``ignored_params``; the dp degree is the EP degree, nothing left to shard)."""
        from ..ep import ExpertParallel, _divided
        from ...moe import MoE

        dp = self.mesh["d1"]
        ignored = set()
        for m in module.modules():
            if isinstance(m, MoE):
                ExpertParallel().apply(m.experts, dp)
                ignored |= set(m.experts.parameters())
        for p in ignored:
            p.register_hook(lambda g, world=dp.size(): _divided(g, world))
        return ignored

    def _fully_shard(self, module: nn.Module, ignored: set = frozenset()) -> None:
        """FSDP2 on the dp sub-mesh, as torchtitan's parallelize does to each model part: the ``wrap`` layers
        of this stage first, then the stage's module (the FSDPModule the schedule drives); ``ignored``: EP's
        experts, left out of every unit."""
        from torch.distributed.fsdp import fully_shard

        o = self.case.target_options
        kw = {"mesh": self.mesh["d1"], "reshard_after_forward": bool(o.get("reshard_after_forward"))}
        if ignored:
            kw["ignored_params"] = set(ignored)
        for fqn in o.get("wrap", ()):
            if fqn.split(".")[1] in module.layers:
                fully_shard(submodule(module, fqn), **kw)
        fully_shard(module, **kw)

    @property
    def dp_dims(self) -> list[int]:
        """The batch is split over the mesh's dp dim (the second), not over the pipeline's."""
        return [1] if self.mesh.ndim == 2 else []

    def batch_groups(self) -> list:
        return [self.dp_group] if self.dp_group is not None else []

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step (``accum`` steps, on equal parts of it) on this dp rank's slice of the batch
        (the whole batch without dp; the inputs on the first stage's rank, the targets everywhere, as
        torchtitan passes them); the last stage's microbatch losses combined as ``objective`` does,
        sent to every rank of the pipeline, averaged over dp."""
        o = self.case.target_options
        dp, accum = o.get("dp", 1), o.get("accum", 1)
        xd, yd = torch.tensor_split(x, dp, 0)[self.dp_rank()], torch.tensor_split(y, dp, 0)[self.dp_rank()]
        steps = []
        for xa, ya in zip(torch.tensor_split(xd, accum, 0), torch.tensor_split(yd, accum, 0)):
            losses = []
            if 0 in self.mine:
                self.schedule.step(xa, target=ya, losses=losses)
            else:
                self.schedule.step(target=ya, losses=losses)
            steps.append([loss.detach().double() for loss in losses])
        self.reduce_tied_grad(model)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        if self.rank == self.last_rank:
            total = accumulate(steps, o)
        dist.broadcast(total, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
            total = total / dp
        return total.to(getattr(torch, self.case.dtype))

    def set_requires_grad(self, model: nn.Module, fqns, flag: bool) -> None:
        params = named_params(model)
        for n in fqns:
            if n in params:  # another rank's param: that rank sets it
                params[n].requires_grad_(flag)

    def _everywhere(self, mine: dict) -> dict:
        """{fqn: value} of every rank's own, on every rank, in the plain model's param order."""
        parts = [None] * self.world
        dist.all_gather_object(parts, {n: _cpu(v) for n, v in mine.items()}, group=self.group)
        merged = {}
        for part in parts:  # the lowest rank's copy of a value two ranks hold (a tie across ranks) ...
            for n, v in part.items():
                merged.setdefault(n, v)
        merged.update(parts[self.rank])  # ... but a rank's own copy where it holds one: the replica oracle compares them
        order = self._order()
        return {n: merged[n] for n in sorted(merged, key=lambda n: order.get(n, len(order)))}

    def _order(self) -> dict:
        return {n: i for i, n in enumerate(param_shapes(self.case.model))}

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """FSDP2's sharded DTensor, whole (a collective over dp); a plain tensor as it is."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    def params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._everywhere({n: self.full(p.detach()) for n, p in named_params(model).items()})

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        return self._everywhere({n: None if p.grad is None else self.full(p.grad.detach())
                                 for n, p in named_params(model).items()})

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        return self._everywhere(state_by_fqn(opt, model, self.full))

    def noncontiguous_grads(self, model: nn.Module) -> list[str]:
        """The grads some rank's step reads non-contiguous (FSDP2's: its local shard), over the pipeline, then dp."""
        from torch.distributed.tensor import DTensor

        local = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in named_params(model).items()}
        mine = sorted(n for n, g in local.items() if g is not None and not g.is_contiguous())
        for group in (self.group, self.dp_group):
            if group is not None:
                parts = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, mine, group=group)
                mine = sorted({n for part in parts for n in part})
        return mine

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        """The case's groups over this rank's params only. A group with none of
        them is left out (torch.optim refuses a group without names beside named
        ones), unless the case's group is empty itself (the reference has it too)
        or the rank has no params at all (then the first group, empty: torch.optim
        refuses an optimizer without groups). ``group_hparams`` puts them back
        together in the case's order."""

        local = named_params(model)
        groups = [dataclasses.replace(g, params=tuple(n for n in g.params if n in local)) for g in self.case.groups]
        self.group_index = [i for i, (g, mine) in enumerate(zip(self.case.groups, groups))
                            if mine.params or not g.params]
        if not self.group_index:
            self.group_index = [0]
        kept = tuple(groups[i] for i in self.group_index)
        return build_optimizer(model, dataclasses.replace(self.case, groups=kept), lr_scale)

    def group_hparams(self, opt) -> list[dict]:
        """Every case group's hyperparameters, from a rank whose optimizer holds
        its params (the lowest), else from one that holds it empty."""
        return self._in_case_order(opt, group_hparams(opt))

    def _in_case_order(self, opt, values: list) -> list:
        """One value per group of this rank's optimizer -> one per case group, in the case's order, each from
        the lowest rank whose optimizer holds the group's params, else from one that holds it empty (a
        collective over the pipeline's ranks)."""
        mine = [(i, bool(g["params"]), v) for i, g, v in zip(self.group_index, opt.param_groups, values)]
        parts = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        out = {}
        for has in (True, False):
            for part in parts:
                for i, full, v in part:
                    if full == has and i not in out:
                        out[i] = v
        return [out[i] for i in sorted(out)]

    def loop(self, opt, model: nn.Module):
        """The training loop (kernel/loop.py) over this rank's optimizer: an LR scheduler steps each rank's
        groups; its last lrs are observed per case group, in the case's order, as the reference's one scheduler
        over all of them. No clipping: a norm over every stage's grads needs a reduction across the stages that
        torch's clip_grad_norm_ does not make (torchtitan #596); no grad scaler (the schedule runs backward)."""
        loop = super().loop(opt, model)
        observe = loop.observe

        def observe_in_case_order() -> dict:
            out = observe()
            if "last_lr" in out:
                out["last_lr"] = torch.tensor(self._in_case_order(opt, out["last_lr"].tolist()), dtype=torch.float64)
            return out

        loop.observe = observe_in_case_order
        return loop


def _cpu(v):
    if isinstance(v, dict):
        return {k: _cpu(t) for k, t in v.items()}
    return None if v is None else v.detach().cpu().clone()
