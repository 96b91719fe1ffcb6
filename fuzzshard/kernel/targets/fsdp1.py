"""Target ``fsdp1``: ``FullyShardedDataParallel`` and its optimizer-state-dict APIs.

``target_options``:
  - ``strategy``: a ``ShardingStrategy`` name; HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2 run on a 2-D mesh (replicate x shard);
  - ``orig_params``: ``use_orig_params``. Without it the optimizer sees one
    FlatParameter per FSDP unit, so such a case has one param group, an
    elementwise optimizer and nothing frozen (strategies/ says why);
  - ``wrap``: submodules that get their own FSDP unit (a ``CustomPolicy``);
    the root is always wrapped;
  - ``ignored``: submodules passed as ``ignored_states``: FSDP leaves their
    params whole and their grads unreduced, so this target all-reduces those
    grads itself, as a user must;
  - ``local`` (loading side of fsdp1_full / fsdp1_legacy): resume without
    FSDP, the saved state re-keyed to param IDs with ``rekey_optim_state_dict``
    and loaded into the plain optimizer (its documented use);
  - ``osd`` (checkpoint kinds fsdp1_*): ``offload_to_cpu`` / ``rank0_only``
    of the state-dict configs on the saving side.
Each rank trains on its slice of the global batch, FSDP averages the grads.
What the oracles read goes through FSDP's own APIs: ``summon_full_params``
for params (and grads with orig params), ``FSDP.optim_state_dict`` under
FULL_STATE_DICT for the optimizer state, every step. Grads of flat params
have no API: they are gathered from the FlatParameter's local shard and
unflattened with its own views.
Checkpoint kinds beyond DSD's full/dcp/broadcast:
  - ``fsdp1_full``: ``model.state_dict()`` + ``FSDP.optim_state_dict`` under
    FULL_STATE_DICT, ``torch.save``; load with ``optim_state_dict_to_load``;
  - ``fsdp1_sharded``: the same under SHARDED_STATE_DICT through ``dcp.save``,
    loaded with ``load_sharded_optimizer_state_dict`` (the documented recipe);
    ``legacy`` in the saving side's options saves ``sharded_optim_state_dict``
    instead, ``flatten`` in the loading side's loads with
    ``flatten_sharded_optim_state_dict`` instead of ``optim_state_dict_to_load``;
  - ``fsdp1_legacy``: ``full_optim_state_dict``, loaded with
    ``shard_full_optim_state_dict`` or ``scatter_full_optim_state_dict``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy,
                                    StateDictType)

from ..state_io import FULL_FILE, STATE_DICT_KINDS, as_tensor, load, save
from ..model import loss_fn, plain_fqn
from ..optim import build_optimizer, optimizer_class, optimizer_kwargs
from ..ac import AC_REENTRANT, apply_ac
from ..sync import draw_sync, sync_cells, sync_problem
from .base import Spec, Target


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), flat: bool = False, loading: bool = False,
                 kind: str = "", **_) -> dict:
    """The sharding strategy (hybrid ones on a 2-D mesh), use_orig_params
    (off only in a ``flat`` case: one group, elementwise, nothing frozen, where
    the flat params can stand in for the originals), the submodules wrapped in
    their own unit (a module holding a tied param stays in its parent's unit,
    as with fsdp2), and for the fsdp1_* checkpoint kinds the state-dict
    config on the saving side and the legacy load API on the loading side."""
    import hypothesis.strategies as st

    if len(mesh_shape) == 2:
        strategy = draw(st.sampled_from(["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]))
    else:
        strategy = draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]))
    owners = sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})
    out = {"strategy": strategy, "orig_params": not flat or draw(st.booleans()),
           "wrap": [m for m in owners if m not in tied and draw(st.booleans())]}
    if kind.startswith("fsdp1_") and not loading:
        out["osd"] = {"offload_to_cpu": draw(st.booleans()), "rank0_only": draw(st.booleans())}
    if kind == "fsdp1_legacy" and loading:
        out["legacy_load"] = draw(st.sampled_from(["shard", "scatter"]))
    # extras, drawn last so the draws above keep their order: modules FSDP ignores
    # (not wrapped, not above a wrapped one) and, on a full kind's loading side,
    # resuming without FSDP through rekey_optim_state_dict
    free = [m for m in owners if m not in tied and not any(w == m or w.startswith(m + ".") for w in out["wrap"])]
    ignored = [m for m in free if draw(st.integers(0, 3)) == 3]  # a shrunk case ignores nothing
    if ignored:
        out["ignored"] = ignored
    if loading and kind in ("fsdp1_full", "fsdp1_legacy") and draw(st.integers(0, 3)) == 3:
        out["local"] = True
    if kind == "fsdp1_sharded" and draw(st.booleans()):  # the legacy sharded APIs
        out["flatten" if loading else "legacy"] = True
    microbatches = draw(st.sampled_from([1, 1, 1, 2, 3]))
    if microbatches > 1:
        out["microbatches"] = microbatches  # grad accumulation, under no_sync() on all but the last
    return out


def draw_late_options(draw, case) -> dict:
    """The gradient sync and loss scaling over the microbatches (kernel/sync.py), one case in four."""
    out = dict(case.target_options)
    sync = draw_sync(draw, case, fsdp2=False)
    if sync:
        out["sync"] = sync
    return out


def check(case) -> str | None:
    """What the sync options (kernel/sync.py) cannot be, on the main side (the loading side draws none)."""
    if case.checkpoint and case.checkpoint.target_options.get("sync"):
        return "sync options are drawn on the main side only"
    return sync_problem(case, case.mesh_shape, case.target_options, fsdp2=False)


KINDS = {**STATE_DICT_KINDS,
         "fsdp1_full": "FSDP.optim_state_dict under FULL_STATE_DICT, torch.save; optim_state_dict_to_load",
         "fsdp1_sharded": "FSDP.optim_state_dict under SHARDED_STATE_DICT through dcp; load_sharded_optimizer_state_dict",
         "fsdp1_legacy": "FSDP.full_optim_state_dict, torch.save; shard_/scatter_full_optim_state_dict"}

HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """A hybrid strategy takes a 2-D mesh: FULL_SHARD on a 1-D one."""
    if options.get("strategy") in HYBRID and len(mesh_shape) == 1:
        options["strategy"] = "FULL_SHARD"
    from ..sync import fit

    return fit(options, mesh_shape)


def coverage(case) -> dict:
    """What a case covered of the training loop (kernel/loop.py): the clip form, the
    scheduler, the grad scaler (and an overflow drawn on purpose), by sharding strategy."""
    opts = case.target_options
    sync = {"gradient sync": sync_cells(opts) | {opts.get("strategy", "FULL_SHARD")}} if opts.get("sync") else {}
    return {**loop_coverage(case, opts.get("strategy", "FULL_SHARD")), **sync}


def loop_coverage(case, where: str = "") -> dict:
    """{"loop features": cells} of a case that uses the training loop ({} else):
    "clip <how>", "lr <scheduler>", "scaler" / "scaler overflow", each with ``where``."""
    cells = set()
    if case.clip:
        cells.add(f"clip {case.clip.how}")
    if case.lr_scheduler:
        cells.add(f"lr {case.lr_scheduler.name}")
    if case.scaler:
        cells.add("scaler overflow" if case.scaler.overflow else "scaler")
    if not cells:
        return {}
    return {"loop features" + (f" ({where})" if where else ""): cells}


class StateNotPlain(AssertionError):
    """The optimizer holds a sharded tensor type where torch.optim holds a plain tensor."""


class FSDP1Target(Target):
    name = "fsdp1"
    # FSDP1 records requires_grad when it wraps; it steps each rank's flat 1-D slice of a param
    # the loop: FSDP's own clip_grad_norm_ (torch.nn.utils' over sharded flat grads would be each rank's
    # norm) and clip_grad_value_ (elementwise: right on any shard), any scheduler, ShardedGradScaler
    spec = Spec(moe={"whole_batch": False, "microbatched": True}, options=draw_options, checkpoint_kinds=KINDS, data_parallel=True, elementwise_only=True,
                may_flatten=True, flags_fixed=lambda options: True, fit_options=fit_options, component="FSDP",
                coverage=coverage, clips=("own", "value"), lr_scheduler=True, scaler=True,
                # activation checkpointing after FSDP wraps (torch's FSDP recipe; kernel/ac.py): torch.utils'
                # checkpoint and checkpoint_wrapper, reentrant or not; not the composable checkpoint (the
                # composable APIs' own, fully_shard's and replicate's)
                ac=("utils", "wrapper", "sac") + AC_REENTRANT, dropout="replay",
                late_options=draw_late_options, check=check)
    localizable = False  # wrapped module names differ from the reference's
    freeze_before_shard = True  # FSDP records requires_grad per original param when it flattens

    @classmethod
    def dropout_world(cls, options: dict, world: int) -> int:
        """``local`` (a loading side without FSDP): every rank runs the whole batch."""
        return 1 if options.get("local") else world

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        self.ignored: list[torch.Tensor] = []
        self.local = bool(case.target_options.get("local"))

    @property
    def orig_params(self) -> bool:
        return self.case.target_options.get("orig_params", True)

    def shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp.wrap import CustomPolicy

        if self.local:
            return apply_ac(model, self.case.target_options)
        opts = self.case.target_options
        chosen = {model.get_submodule(n) for n in opts.get("wrap", [])}
        ignored = [model.get_submodule(n) for n in opts.get("ignored", [])]
        self.ignored = list({id(p): p for m in ignored for p in m.parameters()}.values())  # nested: once
        strategy = opts.get("strategy", "FULL_SHARD")
        mesh = {"device_mesh": self.mesh} if strategy in HYBRID else {"process_group": self.mesh.get_group()}
        model = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=self.orig_params,
                     auto_wrap_policy=CustomPolicy(lambda m: m in chosen), device_id=next(model.parameters()).device,
                     ignored_states=ignored or None, **mesh)
        return apply_ac(model, opts)

    def optimizer(self, model: nn.Module, lr_scale: float = 1.0):
        if self.local:
            return super().optimizer(model, lr_scale)
        if self.orig_params:
            return build_optimizer(model, self.case, lr_scale)  # over named_params: plain FQNs
        # the flat params, in the one group the case has
        o = self.case.optim
        group = {"params": list(model.parameters()),
                 **optimizer_kwargs(self.case.groups[0].overrides, o.tensor_lr, self.case.device, lr_scale)}
        return optimizer_class(o.name)([group], **optimizer_kwargs(o.kwargs, o.tensor_lr, self.case.device,
                                                                         lr_scale))

    def batch_groups(self) -> list:
        return [] if self.local else [self._job_group()]
    @classmethod
    def microbatches(cls, options: dict) -> int:
        """``microbatches``: gradient accumulation, this many forward/backwards a step."""
        return options.get("microbatches", 1)

    @classmethod
    def objective(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
        """``sync`` loss "tokens" (the reference's, on the whole batch): kernel/sync.py."""
        if (options.get("sync") or {}).get("loss") == "tokens":
            from ..sync import objective_tokens

            return objective_tokens(model, x, y, options["sync"])
        return loss_fn(model(x), y)

    @classmethod
    def reference_batch(cls, case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """``sync``: the whole batch, its plain loss scaled to the global objective (kernel/sync.py)."""
        from ..sync import reference_scale

        return x, y, reference_scale(cls, case, k)

    def _sync_forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Microbatches under ``no_sync()`` but the last (``sync`` skip "all", and plain ``microbatches``),
        or syncing every one (skip "none"); ignored params' grads averaged after the last backward."""
        import contextlib

        from .. import sync

        opts = self.case.target_options
        how = opts.get("sync") or {"skip": "all"}

        def controls(i, last):
            return model.no_sync() if how.get("skip", "all") == "all" and not last else contextlib.nullcontext()

        return sync.forward_backward(self, model, x, y, controls, lambda mod, xm, ym: loss_fn(mod(xm), ym),
                                     lambda t: dist.all_reduce(t, group=self._job_group()),
                                     after=self._reduce_ignored, sync=how)

    def _reduce_ignored(self) -> None:
        world = self.mesh.size()
        for p in self.ignored:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self._job_group())
                p.grad.div_(world)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the batch; FSDP averages the grads (ignored
        params' grads are averaged here). ``microbatches`` / ``sync``: kernel/sync.py."""
        if self.local:
            return super().forward_backward(model, x, y)
        if self.case.target_options.get("sync") or self.microbatches(self.case.target_options) > 1:
            return self._sync_forward_backward(model, x, y)
        world = self.mesh.size()
        per = x.shape[0] // world
        r = self.dp_rank()
        loss = loss_fn(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
        self.backward(loss)
        for p in self.ignored:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self._job_group())
                p.grad.div_(world)
        full = loss.detach().clone()
        dist.all_reduce(full, group=self._job_group())
        return full / world

    def grad_scaler(self, **kwargs):
        """ShardedGradScaler, FSDP's (a rank's found_inf all-reduced: each holds
        only its shard's grads), over the job's ranks: its default group
        (``dist.group.WORLD`` read when torch imported the module) is not the job's."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.mesh.device_type, process_group=self._job_group(), **kwargs)

    def clip_own(self, model: nn.Module):
        """``FullyShardedDataParallel.clip_grad_norm_`` of the root (the local
        model's torch.nn.utils.clip_grad_norm_ where ``local`` resumes without FSDP)."""
        if self.local or not isinstance(model, FSDP):
            return lambda max_norm, norm_type: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return model.clip_grad_norm_

    def _job_group(self):
        return dist.group.WORLD  # meshes.job(w) makes ranks 0..w-1 the default group

    def params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.local:
            return super().params(model)
        with FSDP.summon_full_params(model, writeback=False):
            return {plain_fqn(n): p.detach().clone() for n, p in model.named_parameters()}

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        if self.local:
            return super().grads(model)
        if self.orig_params:
            # summon shows a frozen param's grad as zeros; the optimizer sees None (a frozen
            # param is never in the flat grad's reduction): read what the optimizer reads
            with FSDP.summon_full_params(model, writeback=False, with_grads=True):
                return {plain_fqn(n): None if p.grad is None or not p.requires_grad else p.grad.detach().clone()
                        for n, p in model.named_parameters()}
        return self._flat_grads(model)

    def _flat_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Each FlatParameter's grad gathered over its shard group and cut
        into the original params' views (no public API reads these)."""
        from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

        prefix = {id(m._handle): plain_fqn(n) for n, m in model.named_modules()
                  if isinstance(m, FSDP) and m._handle is not None}
        ignored = {id(q) for q in self.ignored}
        out = {plain_fqn(n): None if p.grad is None else p.grad.detach().clone()  # ignored params: whole
               for n, p in model.named_parameters() if id(p) in ignored}
        for handle in _get_fsdp_handles(model):
            fp = handle.flat_param
            pre = prefix[id(handle)]
            names = [f"{pre}.{n}" if pre else n for n in fp._fqns]
            g = fp.grad
            if g is None:
                out.update({n: None for n in names})
                continue
            if handle.uses_sharded_strategy:
                full = torch.empty(fp._padded_unsharded_size, dtype=g.dtype, device=g.device)
                dist.all_gather_into_tensor(full, g.detach().contiguous(), group=handle.process_group)
                g = full[:fp._unpadded_unsharded_size.numel()]
            for n, view in zip(names, handle._get_unflat_views(g)):
                out[n] = view.detach().clone()
        return out

    def optimizer_state(self, opt, model: nn.Module) -> dict:
        """Through ``FSDP.optim_state_dict`` (FULL_STATE_DICT, on every rank).
        offload_to_cpu=False: with the default True, on CPU every state of a
        flat param comes back as a view of one reused buffer (a known finding,
        drawn in the fsdp1_full checkpoint, which must not blind every step)."""
        if self.local:
            return super().optimizer_state(opt, model)
        with _full(model):
            osd = FSDP.optim_state_dict(model, opt)
        for n, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, nn.Parameter):
                    # the names off the first line: it makes the signature
                    raise StateNotPlain(f"a full optimizer state dict holds a {type(v).__name__} where the plain "
                                        f"optimizer holds a tensor\n{n}.{k}")
        return {n: {k: as_tensor(v).detach().cpu().clone() for k, v in sorted(st.items())}
                for n, st in osd["state"].items() if st}

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        kind = self.case.checkpoint.kind
        if kind in ("full", "dcp", "broadcast"):
            return save(self.case, model, opt, path, group)
        osd_opts = self.case.target_options.get("osd", {})
        rank = dist.get_rank()
        if kind == "fsdp1_sharded":
            import torch.distributed.checkpoint as dcp

            with _sharded(model):
                legacy = self.case.target_options.get("legacy")
                osd = FSDP.sharded_optim_state_dict(model, opt) if legacy else FSDP.optim_state_dict(model, opt)
                sd = {"model": model.state_dict(), "optim": osd}
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(path, "dcp")), process_group=group)
            return None
        if kind == "fsdp1_legacy":
            with _full(model, **osd_opts):
                msd = model.state_dict()
            osd = FSDP.full_optim_state_dict(model, opt, rank0_only=osd_opts.get("rank0_only", True))
        else:
            with _full(model, **osd_opts):
                msd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        if rank != 0:
            return None
        torch.save({"model": msd, "optim": osd}, os.path.join(path, FULL_FILE))
        return {"model": msd, "optim": osd}  # both keyed by FQN

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        kind = self.case.checkpoint.kind
        if kind in ("full", "dcp", "broadcast"):
            return load(self.case, model, opt, path, group)
        if kind == "fsdp1_sharded":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

            reader = dcp.FileSystemReader(os.path.join(path, "dcp"))
            with _sharded(model):
                sd = {"model": model.state_dict()}
                dcp.load(sd, storage_reader=reader, process_group=group)
                model.load_state_dict(sd["model"])
                osd = load_sharded_optimizer_state_dict(model_state_dict=sd["model"], optimizer_key="optim",
                                                        storage_reader=reader)["optim"]
                if self.case.checkpoint.target_options.get("flatten"):
                    opt.load_state_dict(FSDP.flatten_sharded_optim_state_dict(osd, model, opt))
                else:
                    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))
            return
        saved = torch.load(os.path.join(path, FULL_FILE), map_location="cpu")
        if self.local:  # into the plain model: the state re-keyed to the optimizer's param IDs
            from torch.distributed.fsdp import OptimStateKeyType

            model.load_state_dict(saved["model"])
            opt.load_state_dict(FSDP.rekey_optim_state_dict(saved["optim"], OptimStateKeyType.PARAM_ID, model,
                                                            optim=opt))
            return
        with _full(model):
            model.load_state_dict(saved["model"])
            if kind == "fsdp1_legacy":
                how = self.case.checkpoint.target_options.get("legacy_load", "shard")
                if how == "scatter":
                    # optim=: without it both assume the optimizer took model.parameters() in order
                    osd = FSDP.scatter_full_optim_state_dict(saved["optim"] if dist.get_rank() == 0 else None, model,
                                                             optim=opt)
                else:
                    osd = FSDP.shard_full_optim_state_dict(saved["optim"], model, optim=opt)
            else:
                osd = FSDP.optim_state_dict_to_load(model, opt, saved["optim"])
            opt.load_state_dict(osd)


def _full(model, offload_to_cpu: bool = False, rank0_only: bool = False):
    return FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only),
                                FullOptimStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only))


def _sharded(model):
    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                                ShardedOptimStateDictConfig())
