"""Target ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (or the
composable ``torch.distributed._composable.replicate``) around the whole model.

Every rank holds the whole model and trains on its slice of the global batch;
DDP averages the grads in buckets during the backward. The optimizer is the
plain torch.optim one on every rank. ``target_options``:
  - ``ddp``: DDP's kwargs where they differ from its defaults: static_graph,
    find_unused_parameters, gradient_as_bucket_view, bucket_cap_mb (tiny: each
    param, or a few, a bucket of its own after the first iteration's rebuild),
    broadcast_buffers, init_sync;
  - ``microbatches``: gradient accumulation, the first m-1 forward/backwards of
    every step (the first step's included) under ``no_sync()``;
  - ``synced_first``: the wrapper's first this many steps sync every
    microbatch (no no_sync): accumulation starts once DDP has seen a step;
  - ``gate``: the FQN of a top-level residual layer whose inner part a rank
    skips on a microbatch whose input sums above 0 (float inputs; tokens: an odd
    sum): the graph changes between steps and between ranks, and the skipped
    params go unused on some ranks only (find_unused_parameters, no static_graph);
  - ``ignore``: params DDP ignores (``_set_params_and_buffers_to_ignore_for_model``),
    whose grads the loop averages by hand, as a user who ignores them must;
  - ``hook``: a comm hook: {"name": allreduce | fp16 | bf16 | fp16_wrapper |
    powersgd, and PowerSGD's "rank", "start", "feedback", "warm", "min_rate"};
  - ``uneven``: per rank, how many schedule steps it runs, under ``Join``;
  - ``replicate``: ``_composable.replicate(model, **ddp)`` in place of the wrapper
    (``set_requires_gradient_sync`` for no_sync);
  - ``plain`` (a loading side): the checkpoint loaded into the plain model
    (DSD's ``set_state_dict`` on it; the ``module`` kind: the wrapper's state
    dict with its ``module.`` prefix consumed), not into the wrapper.
What must hold beyond parity: every rank's grads and params are bit for bit the
same (the replica oracle). Lossy comm hooks are compared within their rounding
(``reference_loss_grads``); PowerSGD's grads (a low-rank approximation by
design) only by the replica oracle, and the steps from them by parity.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ...case import Case
from ..ac import AC_NON_REENTRANT, apply_ac
from ..dropout import draws
from ..model import loss_fn, named_params, plain_fqn, submodule
from ..optim import param_order
from ..oracles import mixed_precision_tolerance, reduction_tolerance
from ..plain import sensitivity, torch_dtype
from ..powersgd import gathered_mismatches, load_powersgd, powersgd_state, resumed_hook, save_powersgd
from ..reference import reduction_length
from ..state_io import STATE_DICT_KINDS, load, save
from .base import Spec, Target
from ..ddp_rules import LOSSY, ac_rule, check, coverage, draw_late_options, draw_options, facts, fit_options
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

MODULE_FILE = "ddp_module.pt"
CHECKPOINT_KINDS = {**STATE_DICT_KINDS,
                    "module": "the wrapper's state_dict() (module. prefix) and optimizer.state_dict(), torch.save on "
                              "rank 0; load_state_dict into the wrapper, or into the plain model (plain)"}


class _JoinShadow(Joinable):
    """A Joinable whose join hook runs ``fn``: a joined rank's part in the
    collectives (and the step) the training loop runs after DDP's."""

    def __init__(self, fn, group, model: nn.Module):
        super().__init__()
        self.fn, self.group, self.device = fn, group, next(model.parameters()).device

    def join_hook(self, **kwargs) -> JoinHook:
        hook = JoinHook()
        hook.main_hook = self.fn
        return hook

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.group


def _gated_forward(layer):
    """A Residual whose inner part is skipped while ``layer._fuzz_skip`` is set."""
    def forward(x):
        return x if layer._fuzz_skip else x + layer.inner(x)
    return forward


def skips(x: torch.Tensor) -> bool:
    """Whether a gated layer is skipped on this microbatch: a function of the input alone."""
    return bool(x.sum() % 2 == 1) if not x.is_floating_point() else bool(x.double().sum() > 0)


@contextlib.contextmanager
def gated(model: nn.Module, fqn: str | None):
    """The model with ``fqn`` gated (``layer._fuzz_skip``), back to itself on leaving."""
    if not fqn:
        yield None
        return
    layer = model.get_submodule(fqn)
    layer._fuzz_skip = False
    layer.forward = _gated_forward(layer)
    try:
        yield layer
    finally:
        del layer.forward
        del layer._fuzz_skip


class DDPTarget(Target):
    name = "ddp"
    spec = Spec(options=draw_options, data_parallel=True, flat_mesh=True, named_params=True,
                late_options=draw_late_options, checkpoint_kinds=CHECKPOINT_KINDS,
                flags_fixed=lambda options: True, check=check, fit_options=fit_options, facts=facts,
                component="DDP", coverage=coverage,
                # full grads on every rank before the step: torch.nn.utils' clips and a plain GradScaler see what
                # a local model's would
                clips=("norm", "two_part", "value"), lr_scheduler=True, scaler=True,
                # checkpointing before DDP wraps (as zero's DDP), non-reentrant: DDP's docs limit the reentrant
                # forms; each rank's dropout masks replayed by the reference on its slice (kernel/dropout.py)
                ac=AC_NON_REENTRANT, ac_rule=ac_rule, dropout="replay")
    freeze_before_shard = True  # DDP registers the params that require grad when it wraps

    @classmethod
    def documented_refusal(cls, case: Case, error: dict) -> bool:
        """DDP over a module with no param that requires grad (all frozen, or ignored): it raises, as documented."""
        return "doesn't have any parameter that requires a gradient" in error.get("message", "")

    @classmethod
    def microbatches(cls, options: dict) -> int:
        return options.get("microbatches", 1)

    @classmethod
    def reference_batch(cls, case, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """With uneven inputs only the ranks that still run step k contribute
        their slices, and DDP averages over the whole world (by its initial
        size): the grad of the sum over active ranks of their mean loss / W."""
        counts = case.target_options.get("uneven")
        if not counts:
            return x, y, 1.0
        per = x.shape[0] // len(counts)
        active = [r for r, n in enumerate(counts) if n > k]
        pick = torch.cat([torch.arange(r * per, (r + 1) * per) for r in active]).to(x.device)
        return x[pick], y[pick], len(active) / len(counts)

    @classmethod
    def held_grad_scale(cls, case, k: int) -> float:
        """DDP all-reduces the accumulated ``.grad``; a joined rank shadows it with zeros (Join's documented
        contribution), not with the grad a param in no param group held from the step before (zero_grad leaves
        it; every rank holds the same): that grad enters the average as held x active / W."""
        counts = case.target_options.get("uneven")
        return sum(n > k for n in counts) / len(counts) if counts else 1.0

    @classmethod
    def reference_loss_grads(cls, case: Case, model: nn.Module, options: dict, world: int, x, y,
                             scale: float = 1.0) -> tuple | None:
        """Where the math is not the plain model's on the whole batch: each
        rank's microbatches on its slice, the gated layer skipped where that
        microbatch's input says (the same function of the same data as the
        sharded run's), the grads averaged in float64. A lossy comm hook rounds
        each rank's grad to its dtype (float16, bfloat16), divides by W there
        and sums W of them there, then casts back: 2(W+1) ulps of that dtype of
        sum|rank grads|/W (oracles.mixed_precision_tolerance, plus half its
        subnormal spacing per rounding; with microbatches, of every running
        grad a sync may round: synced_first syncs each microbatch), beside the float64 sum's own
        reduction tolerance. PowerSGD's grads are a low-rank approximation by
        design: any finite value passes here (the replica oracle compares them)."""
        hook = (options.get("hook") or {}).get("name")
        if not options.get("gate") and hook not in (*LOSSY, "powersgd"):
            return None
        orig = torch_dtype(case)
        params = dict(model.named_parameters())
        per, m = x.shape[0] // world, options.get("microbatches", 1)
        loss, total, spread, sens = torch.zeros((), dtype=torch.float64), {}, {}, {}
        before = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        rounded = {}  # over microbatches i and ranks r: sum_{j<=i} |g_rj| (the running grads a sync may round)
        replay = draws()  # dropout: rank r's masks from r's seed, its microbatches in order (kernel/dropout.py)
        with gated(model, options.get("gate")) as layer:
            for r in range(world):
                acc, seen = {}, {}
                if replay is not None:
                    replay.rank(r)
                for xm, ym in zip(x[r * per:(r + 1) * per].chunk(m), y[r * per:(r + 1) * per].chunk(m)):
                    if layer is not None:
                        layer._fuzz_skip = skips(xm)
                    objective = functools.partial(cls.objective, options=options)
                    probe = objective if replay is None else replay.same_masks(objective)
                    with replay.kept() if replay is not None else contextlib.nullcontext():
                        for key, v in sensitivity(model, params, xm, ym, probe, 1.0 / m).items():
                            sens[key] = sens.get(key, 0.0) + v / world
                    for p in params.values():
                        p.grad = None
                    local = objective(model, xm, ym) / m
                    # GradScaler.scale: times its float32 scale tensor, cast back to the loss's dtype; unscaled below
                    (local if scale == 1.0 else (local * torch.tensor(scale, dtype=torch.float32)).type(local.dtype)).backward()
                    loss = loss + local.detach().double() / world
                    for n, p in params.items():
                        if p.grad is not None:
                            acc[n] = acc[n] + p.grad if n in acc else p.grad.clone()
                            seen[n] = seen.get(n, 0) + p.grad.double().abs() / scale  # this rank's |g| so far
                    for n, g in seen.items():
                        rounded[n] = rounded.get(n, 0) + g
                for n, g in acc.items():
                    g = g.double() / scale
                    total[n] = total.get(n, 0) + g
                    spread[n] = spread.get(n, 0) + g.abs()
        red = reduction_tolerance(case.dtype, reduction_length(case))
        grads, extra = {}, {}
        for n, p in params.items():
            p.grad = before[n]
            new = None if n not in total else (total[n] / world).to(orig)
            grads[n] = before[n] if new is None else new if before[n] is None else before[n] + new
        ignored = set(options.get("ignore", ()))  # DDP leaves them alone: averaged by hand, never compressed
        if hook in LOSSY:
            low = mixed_precision_tolerance(case.dtype, LOSSY[hook], world)
            for n in set(spread) - ignored:
                # a sync every microbatch (synced_first) rounds each running grad, not the total: the sum over
                # microbatches i of every rank's |g| up to i bounds what the syncs' roundings were taken of
                over = rounded[n] if m > 1 else spread[n]
                extra[n] = low["k_ulps"] * (low["u"] * over / world + m * low["eta"])
            red = {**red, "why": f"{red['why']}; plus {low['why']} (comm hook {hook})"}
            if LOSSY[hook] == "float16":  # past float16's range: inf, as the hook's sum gives
                for n, t in total.items():
                    if n in ignored:
                        continue
                    compressed = [t / world]
                    over = compressed[0].to(torch.float16).isinf() & t.isfinite()
                    grads[n] = torch.where(over, t.sign() * torch.inf, grads[n].double()).to(orig)
        elif hook == "powersgd":
            for n in set(total) - ignored:
                extra[n] = torch.full_like(total[n], torch.inf)
            red = {**red, "why": f"{red['why']}; PowerSGD's grads: any finite value (a low-rank approximation)"}
        return loss.to(orig), grads, red, sens, extra

    def __init__(self, case, mesh):
        super().__init__(case, mesh)
        self.group = mesh.get_group()
        self.wrapper = None
        self.joined = False
        self.layer = None
        self.steps_run = 0  # forward_backward calls so far (synced_first)
        self.powersgd, self.resumed, self.round_trip_found = None, None, []  # PowerSGD's state (kernel/powersgd.py)

    @property
    def localizable(self) -> bool:
        """Per-module traces line up with the reference's with one forward per
        step on every rank (a joined rank has none; a gated layer's differ by rank)."""
        o = self.case.target_options
        return not self.counts and not o.get("gate") and self.microbatches(o) == 1

    def full_activation(self, t: torch.Tensor, fqn: str = "") -> torch.Tensor:
        """The global-batch activation from every rank's slice, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self._world())]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def full_activation_grad(self, g: torch.Tensor, fqn: str = "") -> torch.Tensor:
        # each rank's loss is a mean over its slice: its output grads are world x the global ones
        return self.full_activation(g, fqn) / self._world()

    @property
    def counts(self) -> list[int] | None:
        return self.case.target_options.get("uneven")

    def _world(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, model: nn.Module) -> nn.Module:
        o = self.case.target_options
        kwargs = dict(o.get("ddp", {}))
        device = next(model.parameters()).device
        apply_ac(model, o)  # activation checkpointing before DDP wraps (kernel/ac.py)
        if o.get("gate"):  # for the model's life (the reference gates its own model while it computes)
            self.layer = submodule(model, o["gate"])
            self.layer._fuzz_skip = False
            self.layer.forward = _gated_forward(self.layer)
        if o.get("replicate"):
            from torch.distributed._composable.replicate import replicate

            replicate(model, device_id=device, process_group=self.group, **kwargs)
            self.wrapper = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            if o.get("ignore"):  # by the FQNs DDP sees (a CheckpointWrapper's in between: kernel/ac.py)
                real = {plain_fqn(n): n for n, _ in model.named_parameters()}
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [real[n] for n in o["ignore"]])
            self.wrapper = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device],
                                                   process_group=self.group, **kwargs)
        self._register_hook()
        return model  # the plain module: its FQNs; the forward goes through the wrapper

    def _register_hook(self) -> None:
        hook = self.case.target_options.get("hook")
        if self.counts:
            self.wrapper.register_comm_hook(None, self._allreduce_setting_joined_grads)
            return
        if not hook:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

        name = hook["name"]
        if name == "powersgd":
            # powerSGD_hook, each bucket's reduction waited for (on gloo its callbacks' all-reduces race the next
            # bucket's: root cause ddp-powersgd-gloo-callback-collective-order); the state it reads is the
            # target's, which a load of PowerSGD's state swaps (kernel/powersgd.py)
            self.powersgd = powersgd_state(hook, self.group)
            self.wrapper.register_comm_hook(None, self._powersgd_hook)
            return
        fn = {"allreduce": dh.allreduce_hook, "fp16": dh.fp16_compress_hook, "bf16": dh.bf16_compress_hook,
              "fp16_wrapper": dh.fp16_compress_wrapper(dh.allreduce_hook)}[name]
        self.wrapper.register_comm_hook(self.group, fn)

    def _powersgd_hook(self, state, bucket):
        """powerSGD_hook with the target's state, each bucket's reduction run to its end before the next
        bucket's starts (kernel/powersgd.py); after a load, checked against the uninterrupted run's."""
        return (self.resumed or resumed_hook(None, {}, None, []))(self.powersgd, bucket)

    def round_trip_mismatches(self) -> list[dict]:
        """PowerSGD's state: the loaded check's and the resumed run's mismatches, every rank's."""
        if not (self.case.target_options.get("hook") or {}).get("resume"):
            return []
        return gathered_mismatches(self.round_trip_found, self.group)

    def _allreduce_setting_joined_grads(self, state, bucket):
        """DDP's averaging as a comm hook; on a joined rank its result (the active ranks' grads) is made this
        rank's grads, which its shadowed step then steps from (kernel/targets/zero.py's, the same)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        fut = allreduce_hook(self.group, bucket)
        if not self.joined:
            return fut

        def set_grads(done):
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                p.grad = g.detach().clone()
            return done.value()

        return fut.then(set_grads)

    @contextlib.contextmanager
    def uneven(self, model: nn.Module, opt, observe_grads, observe_step, record):
        """Uneven inputs under ``Join([ddp, ...])``: DDP's join hook shadows
        the all-reduce (the comm hook makes its result a joined rank's grads),
        and fuzzshard's own hooks shadow the loop's loss all-reduce, its
        observation gathers and the step (the local optimizer, from those
        grads: what keeps a joined rank's replica with the others')."""
        if not self.counts:
            yield lambda k: True
            return
        pending = {}
        device = next(model.parameters()).device

        def after_backward():
            loss = torch.zeros((), dtype=next(model.parameters()).dtype, device=device)
            dist.all_reduce(loss, group=self.group)
            pending.update({"loss": loss / self._world(), **observe_grads()})

        def after_step():
            record({**pending, **observe_step(), "trace": None})

        mine = self.counts[dist.get_rank(self.group)]
        with Join([self.wrapper, _JoinShadow(after_backward, self.group, model), _JoinShadow(opt.step, self.group, model),
                   _JoinShadow(after_step, self.group, model)]):
            yield lambda k: k < mine
            self.joined = True

    def _sync(self, on: bool):
        """no_sync() as the wrapper has it (replicate(): set_requires_gradient_sync)."""
        if self.case.target_options.get("replicate"):
            self.wrapper.set_requires_gradient_sync(on)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if on else self.wrapper.no_sync()

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice in ``microbatches`` parts, all but the last under
        no_sync (each loss / m); ignored params' grads averaged by hand."""
        world, rank = self._world(), dist.get_rank(self.group)
        m = self.microbatches(self.case.target_options)
        per = x.shape[0] // world
        xs, ys = x[rank * per:(rank + 1) * per].chunk(m), y[rank * per:(rank + 1) * per].chunk(m)
        total = None
        synced = self.steps_run < self.case.target_options.get("synced_first", 0)
        self.steps_run += 1
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if self.layer is not None:
                self.layer._fuzz_skip = skips(xm)
            with self._sync(synced or i == m - 1):
                loss = loss_fn(self.wrapper(xm), ym) / m
                self.backward(loss)
            total = loss.detach().clone() if total is None else total + loss.detach()
        if self.case.target_options.get("replicate"):
            self.wrapper.set_requires_gradient_sync(True)
        params = named_params(model)
        for n in self.case.target_options.get("ignore", ()):
            g = params[n].grad
            if g is not None:
                dist.all_reduce(g, group=self.group)
                g.div_(world)
        dist.all_reduce(total, group=self.group)
        return total / world

    # ---- checkpoints: DSD on the wrapper, or the wrapper's own state_dict ----

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        if (self.case.target_options.get("hook") or {}).get("resume"):  # every rank's PowerSGD state beside it
            save_powersgd(self.powersgd, path, self.group)
        if self.case.checkpoint.kind != "module":
            return save(self.case, self.wrapper, opt, path, group)  # DSD on the wrapper
        rank = dist.get_rank(self.group)
        file = os.path.join(path, MODULE_FILE)
        if rank == 0:
            torch.save({"model": self.wrapper.state_dict(), "optim": opt.state_dict()}, file)
        dist.barrier(group=self.group)
        if rank != 0:
            return None
        saved = torch.load(file, map_location="cpu")
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        msd = dict(saved["model"])
        consume_prefix_in_state_dict_if_present(msd, "module.")
        order = param_order(self.case)
        osd = saved["optim"]
        by_fqn = {"state": {order[i]: st for i, st in osd["state"].items()},
                  "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
        return {"model": msd, "optim": by_fqn}

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        if (self.case.target_options.get("hook") or {}).get("resume"):
            after = self.case.checkpoint.after
            self.powersgd, live, self.round_trip_found = load_powersgd(path, self.group, after)
            names = {id(p): n for n, p in named_params(model).items()}
            self.resumed = resumed_hook(live, names, lambda: after + self.steps_run, self.round_trip_found)
        if self.case.checkpoint.kind != "module":
            plain = self.case.target_options.get("plain")  # set_state_dict on the plain model, or the wrapper
            load(self.case, model if plain else self.wrapper, opt, path, group)
            return
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        saved = torch.load(os.path.join(path, MODULE_FILE), map_location="cpu")
        msd = saved["model"]
        into_wrapper = not self.case.target_options.get("plain") and not self.case.target_options.get("replicate")
        prefixed = all(k.startswith("module.") for k in msd)
        if into_wrapper and prefixed:
            self.wrapper.load_state_dict(msd)  # as saved: DDP's module. prefix on both sides
        else:
            msd = dict(msd)
            consume_prefix_in_state_dict_if_present(msd, "module.")
            (self.wrapper.module if into_wrapper else model).load_state_dict(msd)
        opt.load_state_dict(saved["optim"])
