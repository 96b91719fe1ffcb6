"""Target ``ep``: expert parallelism, as torchtitan's ``ExpertParallel`` + FSDP2 (dp2ep).

Every MoE layer's routed experts (kernel/moe.py's ``GroupedExperts``: w1, w2,
w3 [E, ...]) are sharded on the expert dim over an ``ep`` mesh dim
(``distribute_tensor(.., [Shard(0)])``), and its routed tokens go to the
ranks that own their experts and come back through
``torch.distributed._functional_collectives.all_to_all_single_autograd``
with uneven input and output splits: the token dispatch and combine of
torchtitan's ``ExpertParallel`` (``distribute_module``'s ``input_fn`` and
``output_fn`` around the experts; the split sizes exchanged first with an
``all_to_all_single`` of the per-expert counts, the received tokens permuted
from rank-major to expert-major order). EP borrows the data-parallel ranks,
as torchtitan's dp2ep: every rank trains on its own slice of the global batch.

Meshes: 1-D [ep] (every rank an EP rank; the experts, sharded over all of them,
are left out of FSDP: ``ignored_params``), or 2-D [dp, ep] ("d0" x "d1"): the
experts also ``fully_shard``ed over "d0" (torchtitan's dp_shard_mod_ep mesh,
an FSDP2 + DTensor 2-D param), and everything else (router, shared experts,
the rest of the model) HSDP over both dims (replicated over "d0", sharded
over "d1"). Each rank backwards its slice's mean loss; every FSDP2 reduction
is a sum divided by the data-parallel degree (``set_gradient_divide_factor``,
``set_force_sum_reduction_for_comms``: gloo has no PREMUL_SUM), and an
expert's grad (summed over its EP ranks by the combine's backward, over "d0"
by FSDP, or on a 1-D mesh divided by a hook) is the global batch's mean. The load-balancing counts
(``tokens_per_expert``) and a batch-wise aux loss sum over every rank.

Options: ``wrap`` (MoE submodules, the router or the shared experts, with a
``fully_shard`` of their own) and ``reshard_after_forward``. Dropless only
(a capacity factor counts a rank's own tokens: not the global batch's).

``tp`` (2-D meshes): [dp, tp], torchtitan's EP + TP with EP borrowing the TP
ranks (ETP 1; torchtitan deprecated expert TP): the batch split over "d0" only,
the TP ranks of "d1" see the same tokens. Each MoE's router gate is
torchtitan's ``NoParallel`` over "d1" (its weight a Replicate DTensor, its
output's grad ``Partial``: summed over TP where FSDP2 reduces it), the shared
expert ColwiseParallel w1/w3 and RowwiseParallel w2 with a ``Partial``
output, the routed experts Shard(0) over "d1" (the EP degree is the TP
degree), each TP rank routing its 1/tp slice of the tokens (torchtitan's
dispatcher's ``sp_rank``), the layer's output one Partial -> Replicate over
TP (kernel/moe.py). FSDP2 over "d0" for everything (dp_shard_mod_ep).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module, distribute_tensor

from ...case import Case
from ..ac import AC_NON_REENTRANT, apply_ac
from ..dropout import has_dropout
from ..model import submodule
from ..moe import MoE, moe_configs_of
from ..state_io import STATE_DICT_KINDS
from .base import Spec
from .fsdp2 import FSDP2Target


def _generate_permute_indices(tokens_per_expert_group: torch.Tensor, experts_per_rank: int, num_ranks: int):
    """torchtitan's: indices that reorder the received tokens from rank-major ((e0, r0), (e1, r0), ...,
    (e0, r1), ...) to expert-major ((e0, r0), (e0, r1), ..., (e1, r0), ...) order, and the local experts'
    token counts."""
    device = tokens_per_expert_group.device
    total = int(tokens_per_expert_group.sum())
    t_mat = tokens_per_expert_group.view(num_ranks, experts_per_rank)
    input_starts = (tokens_per_expert_group.cumsum(0) - tokens_per_expert_group).view(num_ranks, experts_per_rank)
    segment_lens = t_mat.t().reshape(-1)
    input_starts = input_starts.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0], device=device).repeat_interleave(segment_lens)
    output_starts = segment_lens.cumsum(0) - segment_lens
    permuted = input_starts[seg_ids] + torch.arange(total, device=device) - output_starts[seg_ids]
    return permuted, t_mat.sum(0)


class ExpertParallel:
    """torchtitan's ``ExpertParallel`` (torchtitan/distributed/expert_parallel.py): the experts' params
    Shard(0) over the EP mesh, the routed tokens dispatched to their experts' ranks and combined back with
    ``all_to_all_single_autograd`` (uneven splits). One instance per MoE layer: it keeps the splits of the
    forward running."""

    def __init__(self):
        self.input_splits = self.output_splits = self.input_shape = self.permuted_indices = None

    @staticmethod
    def _partition_fn(name, mod, device_mesh):
        for param_name, param in mod.named_parameters(recurse=False):
            mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                            requires_grad=param.requires_grad))

    def _token_dispatch(self, mod, inputs, device_mesh):
        from torch.distributed import _functional_collectives as funcol

        routed_input, num_tokens_per_expert = inputs
        ep = device_mesh.shape[0]
        local = num_tokens_per_expert.shape[0] // ep
        group = device_mesh.get_group()
        with torch.no_grad():
            group_counts = funcol.all_to_all_single(num_tokens_per_expert, None, None, group=group)
            group_counts = torch.ops._c10d_functional.wait_tensor(group_counts)
            self.input_splits = num_tokens_per_expert.view(ep, -1).sum(dim=1).tolist()
            self.output_splits = group_counts.view(ep, -1).sum(dim=1).tolist()
        routed_input = funcol.all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)
        self.input_shape = routed_input.shape
        self.permuted_indices, counts = _generate_permute_indices(group_counts, local, ep)
        return routed_input[self.permuted_indices, :], counts

    def _token_combine(self, mod, routed_output, device_mesh):
        from torch.distributed import _functional_collectives as funcol

        out = routed_output.new_empty(self.input_shape)
        out[self.permuted_indices, :] = routed_output
        return funcol.all_to_all_single_autograd(out, self.input_splits, self.output_splits, device_mesh.get_group())

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn,
                                 input_fn=self._token_dispatch, output_fn=self._token_combine)


def _divided(grad, world: int):
    """``grad / world`` on a Shard(0) DTensor grad, divided shard by shard (the same numbers as DTensor's div,
    without its sharding propagation for every new shape: a case's)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad / world
    return DTensor.from_local(grad.to_local() / world, grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=grad.stride())


def no_parallel(module: nn.Module, mesh) -> nn.Module:
    """torchtitan's ``NoParallel(local_output_grad_placements=(Partial(),))``, the router gate's TP style: its
    params Replicate over ``mesh``, its input a Replicate DTensor, its output local with a ``Partial`` grad (each
    TP rank routes its own slice of the tokens, so each holds a part of the scores' grad)."""
    from torch.distributed.tensor import DTensor

    def inputs(mod, args, mesh):
        x = args[0]
        x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *args[1:])

    def output(mod, out, mesh):
        return out.to_local(grad_placements=[Partial()])

    return distribute_module(module, mesh, None, inputs, output)


def apply_moe_tp(moe: nn.Module, tp_mesh) -> None:
    """torchtitan's apply_moe_ep_tp with ETP 1: the router replicated over TP (``no_parallel``), the shared expert
    column-/row-wise with a Partial output (the MoE's output reduces it once), the routed tokens split over TP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    no_parallel(moe.router.gate, tp_mesh)
    if moe.shared_experts is not None:
        parallelize_module(moe.shared_experts, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                         "w2": RowwiseParallel(output_layouts=Partial())})
    moe.tp_mesh = tp_mesh


def _moe_fqns(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, MoE)]


def ep_degree(mesh_shape) -> int:
    """The EP degree: the mesh's last dim (1-D: every rank)."""
    return mesh_shape[-1]


def ep_draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """Which MoE submodules (the router, the shared experts) get their own fully_shard, and
    reshard_after_forward; off first (a shrunk case has neither)."""
    import hypothesis.strategies as st

    units = sorted({n.rsplit(".", 2)[0] for n in shapes if ".router.gate." in n}
                   | {n.rsplit(".", 2)[0] for n in shapes if ".shared_experts." in n})
    wrap = [u for u in units if draw(st.sampled_from([False, False, True]))]
    raf = draw(st.sampled_from([True, False]))
    out = {"reshard_after_forward": raf}
    if wrap:
        out["wrap"] = wrap
    # drawn last, off first: [dp, tp] with EP over the TP ranks (a 2-D mesh only; a checkpoint's side stays off).
    # A shared expert whose hidden width does not divide over TP meets a known torch bug (RowwiseParallel's local
    # input assumed even: tp-rowwise-local-input-assumes-even): drawn rarely there, as fsdp2's TP MLP is
    even = all(s[0] % mesh_shape[-1] == 0 for n, s in shapes.items() if n.endswith("shared_experts.w1.weight"))
    # On, undrawn, in a case a timed session aimed at it (``aim``: the Spec's steered corner; strategies.cases)
    if len(mesh_shape) == 2 and not context.get("loading") and (
            context.get("aim") or draw(st.sampled_from([False, False, True]))) and (
            even or draw(st.integers(0, 7)) == 7):
        out["tp"] = True
    return out


def ep_fit_options(options: dict, mesh_shape, n_steps: int) -> dict:
    """``tp`` needs a 2-D mesh: off on another (the reducer's mesh edits)."""
    if len(mesh_shape) != 2:
        options.pop("tp", None)
    return options


def moe_configs(case: Case) -> list[dict]:
    """The configs (kernel/moe.py) of the MoE layers of a case's model."""
    return moe_configs_of(case.model)


def ep_check(case: Case) -> str | None:
    """EP's rules: the model has an MoE layer, its experts divide evenly over the EP degree (torchtitan's
    num_experts % ep == 0), dropless routing (a capacity counts a rank's own tokens)."""
    sides = [("", case.mesh_shape, case.target_options)]
    if case.checkpoint:
        sides.append(("checkpoint ", case.checkpoint.mesh_shape, case.checkpoint.target_options))
    cfgs = moe_configs(case)
    if not cfgs:
        return "ep shards an MoE's experts: the model has no MoE layer"
    for what, mesh, options in sides:
        if len(mesh) > 2:
            return f"{what}ep runs on a 1-D [ep] or 2-D [dp, ep] mesh, not {list(mesh)}"
        if options.get("tp"):
            if has_dropout(case.model):  # each TP rank's masks on the same tokens: not the replay's per-dp-rank world
                return f"{what}dropout under ep's tp: the reference replays one slice per rank of the world, not of dp"
            if len(mesh) != 2:
                return f"{what}ep's tp runs on a 2-D [dp, tp] mesh, not {list(mesh)}"
            if (case.batch // mesh[0]) * case.seq % mesh[1]:
                return f"{what}ep's tp splits a dp rank's {case.batch // mesh[0]} x {case.seq} tokens over {mesh[1]}"
        for cfg in cfgs:
            if cfg["experts"] % ep_degree(mesh):
                return f"{what}{cfg['experts']} experts do not divide over the EP degree {ep_degree(mesh)}"
    return None


def ep_coverage(case) -> dict:
    """What an EP case covered: its mesh (1-D EP, or 2-D dp x ep with the experts FSDP-sharded over dp),
    shared experts, a routing bias, an aux loss, top-k > 1, grouped_mm, units of their own, a checkpoint (of each
    kind, and to another EP degree)."""
    cfgs = moe_configs(case)
    cells = {"1-D ep" if len(case.mesh_shape) == 1 else "2-D dp x tp" if case.target_options.get("tp")
             else "2-D dp x ep"}
    for c in cfgs:
        cells |= {k for k, on in (("shared experts", c.get("shared")), ("routing bias", c.get("bias_coeff") is not None),
                                  ("aux loss", c.get("aux")), ("top_k > 1", c.get("top_k", 1) > 1),
                                  ("grouped_mm", c.get("grouped"))) if on}
    if case.target_options.get("wrap"):
        cells.add("own units")
    if case.checkpoint:  # the experts' state through a round trip, at another EP degree where it reshards them
        ck = case.checkpoint
        cells.add(f"{ck.kind} checkpoint" + (" to another EP degree" if ep_degree(ck.mesh_shape) != ep_degree(
            case.mesh_shape) else ""))
    return {"ep cases": cells}


def ep_facts(case) -> dict:
    """``composable_ac_of_experts``: the composable checkpoint of an MoE's experts, the module whose forward
    pre-hook is EP's token dispatch (distribute_module's input_fn), which the checkpoint's recompute runs again on
    the dispatched tokens (a torch bug: known composable-checkpoint-reruns-forward-pre-hooks)."""
    from ..ac import ac_how
    from ..moe import moe_prefixes

    experts = {p + "experts" for p in moe_prefixes(case.model)}
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    return {"composable_ac_of_experts": any(ac_how(o) == "composable" and experts & set(o["ac"]) for o in sides)}


def ep_layout(mesh_shape, options: dict, names) -> dict | None:
    return None  # experts Shard(0) over ep, the rest HSDP: no one plain layout


class EPTarget(FSDP2Target):
    name = "ep"
    known_as = ("fsdp2", "dtensor")
    # every model drawn has MoE, its experts a multiple of the EP degree (the mesh's last dim; strategies'
    # _model), dropless: a rank's forward sees its own slice
    spec = Spec(moe={"whole_batch": False, "always": True, "experts_over": -1}, options=ep_draw_options,
                checkpoint_kinds=STATE_DICT_KINDS, fit_options=ep_fit_options,
                data_parallel=True, named_params=True, check=ep_check, coverage=ep_coverage, component="FSDP2", clips=("norm", "two_part", "value"), lr_scheduler=True, layout=ep_layout,
                ac=AC_NON_REENTRANT, dropout="replay", facts=ep_facts,
                # a timed session steers [dp, tp] cases toward ``tp``, without a checkpoint: its loading side draws
                # no tp (ep_draw_options), so a checkpointed tp case runs only the steps before the save under tp
                corner={"option": "tp", "mesh_dims": 2, "checkpoint": False})
    localizable = False  # inside an MoE the routed tokens are this rank's experts', in another order

    @classmethod
    def trace_points(cls, case):
        return None

    @classmethod
    def reference_loss_grads(cls, case, model, options, world, x, y, scale: float = 1.0):
        return None

    @classmethod
    def microbatches(cls, options: dict) -> int:
        return 1

    @property
    def local_replicas(self) -> bool:
        """Under ``tp`` the rest of the model is replicated over TP, each TP rank computing its grads itself."""
        return bool(self.case.target_options.get("tp"))

    @property
    def dp_dims(self) -> list[int]:
        return [0] if self.case.target_options.get("tp") else list(range(self.mesh.ndim))

    def batch_groups(self) -> list:
        return [self.mesh.get_group(d) for d in self.dp_dims]

    def _ep_mesh(self):
        return self.mesh if self.mesh.ndim == 1 else self.mesh["d1"]

    def dp_group(self):
        """Every rank of the job: all are data-parallel (EP borrows them); under ``tp`` the "d0" ranks."""
        if self.case.target_options.get("tp"):
            return self.mesh.get_group(0)
        return self.mesh.get_group() if self.mesh.ndim == 1 else dist.group.WORLD

    def shard(self, model: nn.Module) -> nn.Module:
        opts = self.case.target_options
        ep_mesh = self._ep_mesh()
        kw = {"reshard_after_forward": opts.get("reshard_after_forward", True)}
        tp = bool(opts.get("tp"))
        experts = []
        for fqn in _moe_fqns(model):
            moe = submodule(model, fqn)
            ExpertParallel().apply(moe.experts, ep_mesh)
            if tp:  # EP borrows the TP ranks: the router and shared expert under TP over the same dim
                apply_moe_tp(moe, ep_mesh)
            experts.append(moe.experts)
        # activation checkpointing after EP (and its TP) and before fully_shard: torchtitan's order (parallelize,
        # apply_ac, apply_fsdp; kernel/ac.py, as fsdp2's); a checkpointed block's recompute runs its MoE's
        # dispatch and combine all-to-alls again in backward (selective AC saves them: kernel/ac.py)
        apply_ac(model, opts)
        units = []
        if self.mesh.ndim == 2:  # dp_shard_mod_ep: the experts FSDP-sharded over the dp dim too
            units += [fully_shard(e, mesh=self.mesh["d0"], **kw) for e in experts]
        ignored = {p for e in experts for p in e.parameters()} if self.mesh.ndim == 1 else None
        rest = self.mesh["d0"] if tp else self.mesh  # under tp: FSDP over dp, TP's DTensors 2-D params
        for fqn in sorted(opts.get("wrap", []), key=lambda n: (-n.count("."), n)):
            units.append(fully_shard(submodule(model, fqn), mesh=rest, **kw))
        units.append(fully_shard(model, mesh=rest, ignored_params=ignored, **kw))
        world = self.dp_size()
        for unit in units:  # every reduction a sum over the ranks that hold the grad, then / the dp degree
            unit.set_gradient_divide_factor(float(world))
            unit.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM, then the divide (gloo has no PREMUL_SUM)
        if ignored:  # 1-D: the experts' grads, summed over every rank by the combine's backward, averaged
            for p in ignored:
                p.register_hook(lambda g, world=world: _divided(g, world))
        return model

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice, its mean loss backwarded (and an MoE aux loss's grad of one, torchtitan's): the
        grads averaged over the ranks are the global batch's. Returns the global mean loss."""
        world = self.dp_size()
        per = x.shape[0] // world
        r = self.dp_rank()
        loss = self.objective(model, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per], self.case.target_options)
        self.backward(loss)
        full = loss.detach().double()
        dist.all_reduce(full, group=self.dp_group())
        return (full / world).to(loss.dtype)

    def grad_scaler(self, **kwargs):
        raise NotImplementedError("ep draws no grad scaler")
