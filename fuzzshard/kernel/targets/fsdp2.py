"""Target ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` + a plain torch.optim optimizer.

The Case's ``target_options`` name the submodules that get their own
``fully_shard`` (applied deepest first, then the root), ``reshard_after_forward``,
``offload`` (CPUOffloadPolicy), ``built_as`` (the model is built in this
dtype and moved to the case's with ``model.to`` after ``fully_shard``), ``mp`` (a MixedPrecisionPolicy for every
unit, replayed in the reference by mixed_precision_reference below), ``ac`` (submodules under composable activation
checkpointing, or with ``ac_wrapper`` under ``apply_activation_checkpointing``'s CheckpointWrapper; with ``ac_how``
any non-reentrant form of kernel/ac.py), ``microbatches`` (gradient accumulation: every microbatch
but the last runs with ``set_requires_gradient_sync(False)``; with ``sync`` the drawn
gradient-sync controls and loss scaling of kernel/sync.py), ``tp``
(tensor parallel: {linear or embedding FQN: "colwise" | "rowwise"}; for the
decoder transformer torchtitan's plan, {module FQN: decoder.TP_STYLES key},
with ``sp`` (sequence parallelism) and ``loss_parallel``) and
``nonroot`` (the loss also calls the wrapped layers.0 from outside the root's
forward: FSDP2's non-root forward; see ``objective``), ``tie_unit`` (a tied
weight's two modules in one grouped unit, ``fully_shard([embedding, head])``), and with ``--compile``
``compile`` (each block ``module.compile()``d "before" or "after"
``fully_shard``) and ``compile_step`` (the optimizer step under torch.compile);
the reference stays eager.
A 2-D mesh means HSDP (replicate x shard), or with ``tp`` TP + FSDP2:
``parallelize_module`` on the inner dim, ``fully_shard`` on the outer. Each
data-parallel rank trains on its slice of the global batch (the TP ranks of
one slice see the same one); FSDP averages the grads, which equals the grad
of the global mean loss the reference computes on the whole batch.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ...case import Case
from ..decoder import parallelize_decoder, plan_element
from ..dropout import draws
from ..float8 import float8_convert, float8_precompute, float8_reference
from ..gather import full_batched
from ..lowbit import lowbit_allowance, lowbit_class, lowbit_plain, LOWBIT_OPTIMIZERS
from ..model import loss_fn, reused_unit_params, submodule, tie_uses
from ..moe import Routing, set_aux_grad
from ..oracles import compiled_step_tolerance, mixed_precision_tolerance
from ..plain import sensitivity, torch_dtype
from ..reference import scalar_dtype
from ..state_io import STATE_DICT_KINDS
from ..ac import AC_NON_REENTRANT, ac_how, apply_ac
from .base import Spec, Target


# its draws and rules (what a case draws and cannot be, its facts and coverage) live beside the kernel
from ..fsdp2_rules import check, coverage, draw_late_options, draw_options, facts, fit_options, seq_multiple  # noqa: F401


def compiled(case) -> str:
    """--compile's draws, for signatures: "compiled" (blocks or the step), or
    "compiled_ckpt" where a compiled block holds a module under the composable
    checkpoint (a torch bug of its own: known/, compile-composable-checkpoint-wrong-grads)."""
    opts = case.target_options
    if not (opts.get("compile") or opts.get("compile_step")):
        return ""
    return "compiled_ckpt" if opts.get("compile") and ac_how(opts) == "composable" else "compiled"


def apply_tp(model: nn.Module, tp_mesh, options: dict, factory: str) -> None:
    """The options' TP plan, ``parallelize_module`` on ``tp_mesh``: the decoder
    transformer's as torchtitan's (``parallelize_decoder``), else a style per
    Linear or Embedding. Every TP module there takes and gives a replicated
    plain tensor, so any layer can be one whatever its neighbours are (colwise
    all-gathers its output, rowwise shards its input and all-reduces its output)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if factory == "decoder":
        tied = model.output.weight is model.tok_embeddings.weight
        parallelize_decoder(model, tp_mesh, options.get("tp") or {}, options.get("sp", False),
                            options.get("loss_parallel", False), options.get("float8"))
        if tied:  # parallelize_module distributed each owner's weight on its own: tied again, as torchtitan does
            model.output.weight = model.tok_embeddings.weight
        return
    style = {"colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
             "rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    float8 = set((options.get("float8") or {}).get("linears", ()))
    if float8:  # the tp target's float8 Linears (--ao): torchao's float8 styles, same layouts (kernel/float8.py)
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        style8 = {"colwise": lambda: Float8ColwiseParallel(output_layouts=Replicate()),
                  "rowwise": lambda: Float8RowwiseParallel(input_layouts=Replicate())}
    if options.get("tp"):
        parallelize_module(model, tp_mesh, {fqn: (style8 if fqn in float8 else style)[s]()
                                            for fqn, s in options["tp"].items()})


def loss_context(options: dict):
    """loss_parallel: cross-entropy on the vocabulary-sharded logits, forward and backward."""
    if options.get("loss_parallel"):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _gather_along(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank of ``group``'s ``t``, concatenated along ``dim`` in group rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def mixed_precision_reference(case: Case, model, options: dict, world: int, x, y, scale: float = 1.0) -> tuple:
    """fsdp2's MixedPrecisionPolicy, replayed with the same casts: each
    data-parallel rank's slice runs forward/backward on a copy of the model
    whose params are in param_dtype, with FSDP2's casts at every unit (float
    inputs to param_dtype when cast_forward_inputs, outputs to output_dtype;
    buffers keep their dtype). With gradient accumulation each rank runs its
    microbatches (loss / m each) and adds their grads in reduce_dtype, in
    place, as FSDP2 accumulates unsynced unsharded grads. Each rank's grads
    are cast to reduce_dtype and averaged exactly. The sharded run reduces the
    same W values in reduce_dtype (W-1 sums, a pre- and a post-divide, the
    cast back) after m-1 accumulating adds: see oracles.mixed_precision_tolerance, of
    sum|microbatch grads|/W. Per-rank compute is the same
    code on the same values, up to kernel rounding, which the sensitivity
    (one-ulp nudges in param_dtype) bounds.
    ``scale``: the grad scaler's scale this step (kernel/loop.py). Each
    microbatch's loss is scaled as ``GradScaler.scale`` does (times the float32
    scale, in the loss's dtype), so the low-precision grads are the scaled ones
    the sharded run computes (no underflow where the scale lifts them; inf
    where it overflows them, per rank or in a float16 reduction's sum after
    FSDP2's pre-divide), and unscaled in the original dtype, as
    ``unscale_`` does to the reduced grads (a power of two: exact).
    A unit the forward calls twice (``split_reduced``) reduces its earlier
    microbatches' sum and its last microbatch's grad apart, as FSDP2 does.
    Returns (loss, grads, tolerance, sensitivity, elementwise allowance)."""
    mp, orig = options["mp"], torch_dtype(case)
    compute_name = mp["param_dtype"] or case.dtype
    reduce_name = mp["reduce_dtype"] or compute_name
    compute, reduce = getattr(torch, compute_name), getattr(torch, reduce_name)
    out_dtype = getattr(torch, mp["output_dtype"]) if mp["output_dtype"] else None
    low = copy.deepcopy(model)
    with torch.no_grad():
        for p in low.parameters():
            p.grad = None
            p.data = p.data.to(compute)
    # (a grouped unit, fully_shard([a, b]) as tie_unit's, casts each module's inputs and outputs as a unit does)
    for fqn in ["", *options.get("wrap", []), *(tie_uses(case.model) if options.get("tie_unit") else ())]:
        unit = low.get_submodule(fqn)
        if mp["cast_forward_inputs"] and mp["param_dtype"]:
            unit.register_forward_pre_hook(lambda m, a, kw: (_cast(a, compute), _cast(kw, compute)), with_kwargs=True)
        if out_dtype is not None:
            unit.register_forward_hook(lambda m, a, out: _cast(out, out_dtype))
    params = dict(low.named_parameters())
    set_aux_grad(low, scale)  # an MoE aux loss's grad in the scaled backward below, as the sharded run's
    per, m = x.shape[0] // world, options.get("microbatches", 1)
    split = split_reduced(case, options)
    loss, total, last, spread, sens = 0.0, {}, {}, {}, {}
    replay = draws()  # dropout: each rank's masks as it drew them (kernel/dropout.py)
    routing = Routing()  # an MoE's routing in param_dtype: the counts and margin of the passes below, not the nudged ones
    for r in range(world):
        acc, apart = {}, {}
        if replay:
            replay.rank(r)
        for i, (xm, ym) in enumerate(zip(x[r * per:(r + 1) * per].chunk(m), y[r * per:(r + 1) * per].chunk(m))):
            objective = functools.partial(FSDP2Target.objective, options=options)
            # the probe's forwards each draw this microbatch's masks, and leave the generator as it was
            with replay.kept() if replay else contextlib.nullcontext():
                probe = sensitivity(low, params, xm, ym, replay.same_masks(objective) if replay else objective, 1.0 / m)
            for key, v in probe.items():
                sens[key] = sens.get(key, 0.0) + v / world
            for p in params.values():
                p.grad = None
            routing.start(low)
            local = FSDP2Target.objective(low, xm, ym, options) / m
            routing.add(low)
            # GradScaler.scale: times its float32 scale tensor, cast back to the loss's dtype
            (local if scale == 1.0 else (local * torch.tensor(scale, dtype=torch.float32)).type(local.dtype)).backward()
            loss += local.detach().double() / world
            for n, p in params.items():
                if p.grad is not None:
                    into = apart if n in split and i == m - 1 else acc
                    if n in into:
                        into[n] += p.grad  # in reduce_dtype, rounded once per add
                    else:
                        into[n] = p.grad.to(reduce)
                    spread[n] = spread.get(n, 0) + p.grad.double().abs() / scale
        for sums, part in ((total, acc), (last, apart)):
            for n, g in part.items():
                sums[n] = sums.get(n, 0) + g.double()
    tol = mixed_precision_tolerance(compute_name, reduce_name, world, m)
    grads = {}
    pre = _predivide(world) if reduce == torch.float16 else None
    for n, p in model.named_parameters():  # FSDP2 adds to a grad the param still holds (frozen, or zeroed not None)
        new = None
        if n in total or n in last:  # each reduce-scatter's output is added to the sharded grad in orig dtype
            mean = sum(_reduced(sums[n], world, pre, reduce) for sums in (total, last) if n in sums)
            new = (mean.to(orig) if scale == 1.0 else mean.to(orig) * (1.0 / scale))  # unscale_: in orig dtype
        grads[n] = p.grad if new is None else new if p.grad is None else p.grad + new
    extra = {n: tol["k_ulps"] * tol["u"] * spread[n] / world for n in spread}
    routing.put(model)
    return loss.to(orig), grads, tol, sens, extra


def _reduced(total: torch.Tensor, world: int, pre: int | None, reduce: torch.dtype) -> torch.Tensor:
    """The average of the ranks' grads summed in ``total`` (float64), as FSDP2's reduction makes it."""
    mean = total / world
    if pre is not None:  # FSDP2 sums g / pre in float16: a sum past its range is inf (nan stays nan)
        over = (total / pre).to(reduce).isinf() & total.isfinite()
        mean = torch.where(over, total.sign() * torch.inf, mean)
    return mean


def split_reduced(case: Case, options: dict) -> set[str]:
    """The params FSDP2 reduces twice a step under gradient accumulation: those of a unit the forward calls
    twice (inside a twice layer's inner, model.reused_unit_params). Its post-backward hook runs at each call's input
    grad; the later call's comes first, before autograd has accumulated the param's grad of both calls, so with
    ``set_requires_gradient_sync(True)`` that hook reduce-scatters what the earlier microbatches accumulated alone
    (FSDPParamGroup.post_backward), and the earlier call's hook the last microbatch's grad. Both outputs are
    added to the sharded grad in the original dtype: the same average, but the float16 sum of all microbatches'
    grads that a single reduction holds (and may overflow) is never made. (One call, or one microbatch: one.)"""
    return reused_unit_params(case.model, options.get("wrap", ())) if options.get("microbatches", 1) > 1 else set()


def _predivide(world: int) -> int:
    """FSDP2's pre-divide factor for a float16 reduction over ``world`` ranks
    (_fsdp_collectives._get_gradient_divide_factors: ~sqrt(world), a power of two)."""
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre


def _cast(tree, dtype):
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)


def fsdp2_tie(case) -> str:
    """The tie's unit: a grouped one of its own (tie_unit) or the root's; with TP, vocabulary-parallel or not."""
    if not tie_uses(case.model):
        return ""
    opts = case.target_options
    tp = (opts.get("tp") or {}).get("tok_embeddings") == "rowwise"
    return (f"own unit fully_shard([{', '.join(tie_uses(case.model))}])" if opts.get("tie_unit") else "root's unit") + (", vocab-parallel" if tp else "")


def fsdp2_layout(mesh_shape, options: dict, names) -> dict | None:
    """fully_shard: dim 0 over the last mesh dim (HSDP replicates over the first); a TP plan: no plain layout."""
    return None if options.get("tp") else {n: ["R"] * (len(mesh_shape) - 1) + ["S0"] for n in names}


class FSDP2Target(Target):
    name = "fsdp2"
    spec = Spec(moe={"whole_batch": False}, options=draw_options, checkpoint_kinds=STATE_DICT_KINDS, data_parallel=True, named_params=True,
                late_options=draw_late_options, coverage=coverage, check=check, facts=facts, compiled=compiled,
                seq_multiple=seq_multiple, fit_options=fit_options, component="FSDP2",
                clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True, amp_scaler=True,
                layout=fsdp2_layout, ac=AC_NON_REENTRANT, dropout="replay",
                tie=fsdp2_tie)

    @classmethod
    def step_device(cls, options: dict, device: str) -> str:
        """CPUOffloadPolicy: "the optimizer step runs on CPU with CPU optimizer states"."""
        return "cpu" if options.get("offload") else device

    @classmethod
    def objective(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
        """``nonroot``: plus a call of layers.0 (its own fully_shard) straight on
        the input, from outside the root's forward. ``sync`` loss "tokens" (the reference's, on the whole
        batch): the weighed token sum over the global token count (kernel/sync.py)."""
        if (options.get("sync") or {}).get("loss") == "tokens":
            from ..sync import objective_tokens

            return objective_tokens(model, x, y, options["sync"])
        loss = loss_fn(model(x), y)
        if options.get("nonroot"):
            loss = loss + submodule(model, "layers.0")(x).square().mean()
        return loss

    @classmethod
    def step_tolerance(cls, case: Case, tol: dict) -> dict:
        """``compile_step``: the compiled step's bound (oracles.compiled_step_tolerance)."""
        if case.optim.name in LOWBIT_OPTIMIZERS:  # the state's allowance is its own (state_allowance)
            return {**tol, "why": tol["why"] + "; a low-bit state also one code interval of its format at the "
                    "element's block, times the block's amax (kernel/lowbit.py)"}
        if not case.target_options.get("compile_step"):
            return tol
        return compiled_step_tolerance(tol, case.dtype, case.optim.kwargs.get("betas", ()), scalar_dtype(case))

    def build_dtype(self) -> str:
        """``built_as``: built in this dtype; ``shard`` moves it to the case's with model.to()."""
        return self.case.target_options.get("built_as", self.case.dtype)

    @classmethod
    def reference_loss_grads(cls, case: Case, model: nn.Module, options: dict, world: int, x, y,
                             scale: float = 1.0) -> tuple | None:
        if options.get("float8"):  # the same float8 model unsharded (kernel/float8.py)
            return float8_reference(case, model, options, world, x, y, cls.objective, scale)
        return mixed_precision_reference(case, model, options, world, x, y, scale) if options.get("mp") else None

    @classmethod
    def microbatches(cls, options: dict) -> int:
        """``microbatches``: gradient accumulation, this many forward/backwards a step."""
        return options.get("microbatches", 1)

    @classmethod
    def reference_batch(cls, case: Case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """``sync``: the whole batch, its plain loss scaled to the global objective (kernel/sync.py)."""
        from ..sync import reference_scale

        return x, y, reference_scale(cls, case, k)

    @property
    def local_replicas(self) -> bool:
        """Under TP a param the plan leaves whole is replicated over the TP dim,
        and each TP rank computes its grad itself."""
        return bool(self.case.target_options.get("tp"))

    @property
    def localizable(self) -> bool:
        """Per-module traces line up with the reference's only with one forward
        per step, and in the same dtype."""
        opts = self.case.target_options
        # (a compiled block's submodules run inside its graph: no hooks of their own)
        return (self.microbatches(opts) == 1 and not opts.get("mp") and not opts.get("compile")
                and not opts.get("sync") and not opts.get("float8"))

    @classmethod
    def trace_points(cls, case: Case):
        """A decoder under TP is traced at its plan's elements (the embedding,
        each block's norms, attention and MLP, the final norm, the head): inside
        attention and the MLP the activations are head- or hidden-sharded, at
        their boundaries whole or sequence-sharded (full_activation gathers them)."""
        return plan_element if case.model.factory == "decoder" and case.target_options.get("tp") else None

    @property
    def dp_dims(self) -> list[int]:
        """The mesh dims the batch is split over: all of them but TP's."""
        return [0] if self.case.target_options.get("tp") else super().dp_dims

    def batch_groups(self) -> list:
        return [self.mesh.get_group(d) for d in self.dp_dims]

    def shard(self, model: nn.Module) -> nn.Module:
        opts = self.case.target_options
        mesh = self.mesh
        if opts.get("float8"):  # torchao's float8 Linears first, by their FQNs (kernel/float8.py), as torchtitan
            # converts them: before activation checkpointing and fully_shard
            float8_convert(model, opts["float8"], self.mesh.device_type)
        if opts.get("tp"):
            apply_tp(model, mesh["d1"], opts, self.case.model.factory)
            mesh = mesh["d0"]
        # activation checkpointing before fully_shard (torchtitan's order; kernel/ac.py): the composable
        # checkpoint, or a CheckpointWrapper in between (FQNs gain _checkpoint_wrapped_module, which
        # named_params and submodule leave out); non-reentrant forms only (fully_shard's tests and torchtitan's)
        apply_ac(model, opts)
        kw = {"mesh": mesh, "reshard_after_forward": opts.get("reshard_after_forward", True),
              "offload_policy": CPUOffloadPolicy(pin_memory=False) if opts.get("offload") else OffloadPolicy()}
        if opts.get("mp"):
            mp = opts["mp"]
            kw["mp_policy"] = MixedPrecisionPolicy(
                **{k: getattr(torch, mp[k]) if mp[k] else None for k in ("param_dtype", "reduce_dtype", "output_dtype")},
                cast_forward_inputs=mp["cast_forward_inputs"])
        if opts.get("compile") == "before":
            self._compile_blocks(model)
        for fqn in sorted(opts.get("wrap", []), key=lambda n: (-n.count("."), n)):  # children before parents
            fully_shard(submodule(model, fqn), **kw)
        if opts.get("tie_unit"):  # a tied param's modules in one unit, as FSDP2 asks of shared params
            fully_shard([submodule(model, fqn) for fqn in tie_uses(self.case.model)], **kw)
        fully_shard(model, **kw)
        if opts.get("compile") == "after":
            self._compile_blocks(model)
        if opts.get("built_as"):  # model.to(dtype) after fully_shard: FSDP2 re-registers its sharded params
            model.to(getattr(torch, self.case.dtype))
        if opts.get("sync"):  # the divide factor and sum-only comms (kernel/sync.py)
            from ..sync import fsdp2_reduce_options

            fsdp2_reduce_options(model, opts["sync"])
        return model

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice, in ``microbatches`` equal parts, each loss scaled
        by 1/microbatches; the grads sync on the last one only. Returns the
        global mean loss. ``sync``: the drawn controls and loss scaling (kernel/sync.py)."""
        if self.case.target_options.get("sync"):
            return self._sync_forward_backward(model, x, y)
        world, k = self.dp_size(), self.microbatches(self.case.target_options)
        per = x.shape[0] // world
        r = self.dp_rank()
        xs, ys = x[r * per:(r + 1) * per].chunk(k), y[r * per:(r + 1) * per].chunk(k)
        losses = []
        if self.case.target_options.get("float8"):  # the float8 all-gather's scales, once a step
            float8_precompute(model, self.case.target_options["float8"])
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if k > 1:
                model.set_requires_gradient_sync(i == k - 1)
            with self._loss_context():
                loss = self.objective(model, xm, ym, self.case.target_options) / k
                self.backward(loss)
            losses.append(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())
        # the global mean is an observation, summed in float64: a bfloat16 loss (mixed precision) summed in
        # its own dtype over the ranks would round where the reference's does not
        full = torch.stack(losses).double().sum()
        for dim in self.dp_dims:
            dist.all_reduce(full, group=self.mesh.get_group(dim))
        return (full / world).to(torch_dtype(self.case))

    def _sync_forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from .. import sync

        opts = self.case.target_options

        def reduce(t):
            for dim in self.dp_dims:
                dist.all_reduce(t, group=self.mesh.get_group(dim))

        return sync.forward_backward(self, model, x, y, lambda i, last: sync.fsdp2_controls(model, opts["sync"], last),
                                     lambda mod, xm, ym: self.objective(mod, xm, ym, opts), reduce, self._loss_context)

    @staticmethod
    def _compile_blocks(model: nn.Module) -> None:
        """torch.compile each block (``layers.*``; a model without them whole)
        in place, as torchtitan does (``module.compile()``: FQNs and hooks stay)."""
        blocks = list(submodule(model, "layers").children()) if hasattr(model, "layers") else [model]
        for block in blocks:
            block.compile()

    def grad_scaler(self, **kwargs):
        """FSDP's ShardedGradScaler (its DTensor grads unscaled locally, found_inf
        all-reduced), on a group of every rank of the mesh: the 1-D mesh's own,
        else the job's (HSDP and TP + FSDP: ranks 0..W-1, the default group).
        Never its default ``process_group=dist.group.WORLD``: that default is
        read when torch imports the module, so it names whatever the default
        group was then, not the job's. (torchtitan's docs pair FSDP2 with plain
        ``amp.GradScaler``, whose DTensor unscale reduces found_inf over the
        first grad's mesh itself; a user of FSDP1 moving to FSDP2 keeps this one.)"""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        group = self.mesh.get_group() if self.mesh.ndim == 1 else dist.group.WORLD
        return ShardedGradScaler(self.mesh.device_type, process_group=group, **kwargs)

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        if self.case.optim.name in LOWBIT_OPTIMIZERS:  # torchao's own (--ao; the reference's keeps float32 state)
            from ..optim import build_optimizer

            return build_optimizer(model, self.case, lr_scale, construct=lowbit_class(self.case.optim.name))
        opt = super().optimizer(model, lr_scale)
        if self.case.target_options.get("compile_step"):  # the step compiled, as torch's compiled-optimizer recipe
            eager = opt.step
            compiled_step = torch.compile(lambda: eager(), fullgraph=False)
            # a method of opt still, as an LR scheduler expects (it wraps opt.step.__func__): a plain function
            # there raised AttributeError in the scheduler's constructor (fuzzshard's own, not torch's)
            opt.step = types.MethodType(lambda self, closure=None: compiled_step(), opt)
        return opt

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        """A low-bit optimizer's quantized state as the float32 values it stands for (kernel/lowbit.py)."""
        if self.case.optim.name not in LOWBIT_OPTIMIZERS:
            return super().optimizer_state(opt, model)
        from ..optim import state_by_fqn

        return state_by_fqn(opt, model, lambda t: self.full(lowbit_plain(t)))

    @classmethod
    def state_allowance(cls, case: Case, k: int, state: dict) -> dict:
        """A low-bit optimizer's state: its quantization error, per element (kernel/lowbit.py)."""
        return lowbit_allowance(case, k, state)

    def _loss_context(self):
        return loss_context(self.case.target_options)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        if t.device.type != t.device_mesh.device_type:  # CPU-offloaded: gathered on the mesh's device (NCCL)
            return t.to(t.device_mesh.device_type).full_tensor().to(t.device)
        return full_batched(t, DTensor.full_tensor)

    def _gather_batch(self, t: torch.Tensor) -> torch.Tensor:
        """The global-batch tensor from every rank's slice, in data-parallel rank order."""
        for dim in reversed(self.dp_dims):  # innermost dim first: rank = c0 * size1 + c1
            t = _gather_along(t, self.mesh.get_group(dim), 0)
        return t

    def full_activation(self, t: torch.Tensor, fqn: str = "") -> torch.Tensor:
        return self._gather_batch(self._gather_sequence(t, fqn))

    def full_activation_grad(self, g: torch.Tensor, fqn: str = "") -> torch.Tensor:
        # each rank's loss is a mean over its slice: its output grads are world x the global ones
        return self._gather_batch(self._gather_sequence(g, fqn)) / self.dp_size()

    def _gather_sequence(self, t: torch.Tensor, fqn: str) -> torch.Tensor:
        """Under sequence parallelism a decoder element's plain output (and its
        grad) is this TP rank's part of the sequence (dim 1), but the head's,
        whose input is gathered: the whole sequence, in TP rank order. A
        DTensor (a SequenceParallel norm's output, loss_parallel's logits) says
        its own layout."""
        if isinstance(t, DTensor) or not self.case.target_options.get("sp") or fqn == "output":
            return self.full(t)
        return _gather_along(t, self.mesh.get_group(1), 1)
