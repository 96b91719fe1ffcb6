"""Run one Case: the sharded training on every rank, then the reference check.

The sharded run records, after every step, the full (gathered) loss, grads,
params, optimizer state and param-group hyperparameters. The reporting rank
then replays the reference *anchored*: before step k it loads the sharded
run's params and state after step k-1, so float noise never compounds over
steps and every divergence is caught at the step that made it:
  - loss and grads of step k vs the reference forward/backward on the same
    params and data (reduction tolerance);
  - params, state and hyperparameters after step k vs the reference
    optimizer stepping from the same params, state *and grads* (step tolerance).
With a checkpoint in the case, the run stops after the save step, saves,
and a fresh model + optimizer on the loading world (another size, mesh or
wrapping) loads and runs the remaining steps; checkpoint.py says what the
round trip must preserve, and the continued steps get the same parity check.
A verdict is the dict verdict.py's builders make: status pass | invalid | finding.

Where the ranks run is the ``meshes`` a case is handed, a kernel/mesh.py
``World``: the seam. Besides its meshes, groups and jobs it says what every
rank makes alike (``made_alike``: the model before sharding, each step's
batch), what the reporting rank holds of the observations (``observed``) and
which full copies gather.py may batch (``batchable``). Real process groups
(mesh.Meshes) take the defaults; kernel/simulated.py's SimulatedWorld (every
rank in one process, under LocalTensorMode: ``fuzz --simulate``) gives its own,
and nothing here changes for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from ..case import Case
from ..verdict import Status, error_record, finding, invalid, passing
from .checkpoint import check_loaded, check_loaded_loop, check_saved
from .ac import ac_uses  # a recomputed forward traces its modules twice: not localized
from .dropout import draw_from
from .gather import gather_batch
from .localize import Trace
from .model import build_model, make_batch
from .moe import moe_configs_of, observe_biases, set_aux_grad, update_expert_bias, wire
from .optim import RESUME_LR_SCALE, adds_groups_before
from .plain import setup, torch_dtype
from .reference import check_parity, reference_error


def run_case(case: Case, meshes, target_cls, device: str, reporter: bool, timings: dict | None = None,
             localize: bool = False, ckpt_dir: str | None = None) -> dict | None:
    """Ranks 0..case.ranks-1 call this (``meshes``: kernel/mesh.py); only the
    reporter returns a verdict unless the sharded run raised here (then this
    rank returns the error verdict). ``ckpt_dir``: an empty directory that
    every rank sees, for a case with a checkpoint."""
    clock = Clock(timings)
    _ieee_float32()
    try:
        with clock("reference"):
            setup(case, device)
    except Exception as e:  # the reference itself rejects the config
        return invalid(f"reference rejects the config: {error_record(e)['text']}")
    with clock("sharded"):
        obs, error = _run_sharded(case, meshes, target_cls, device, keep=reporter, localize=localize,
                                  ckpt_dir=ckpt_dir, clock=clock)
    obs = meshes.observed(obs)  # what the reporting rank holds (the World seam)
    if error is not None:
        if _documented_refusal(case, error) or target_cls.documented_refusal(case, error):
            return invalid(f"documented: {error['text']}")
        ref_error = next(filter(None, (reference_error(case, d, target_cls)
                                       for d in target_cls.step_devices(case, device))), None)
        if ref_error is not None:
            return invalid(f"reference raises too: {ref_error['text']}", error=error)
        loaded = _check_round_trip(case, obs, device) if obs and obs["loaded"] is not None else []
        if loaded:  # the earliest divergence: a load that changed something explains an error after it
            return finding("checkpoint", loaded, then=error)
        return finding("error_parity", error=error)
    if not reporter:
        return None
    with clock("reference"):
        verdict = check_parity(case, obs, device, target_cls, localize=localize, clock=clock)
    if case.checkpoint and not _fails_before_save(case, verdict):
        with clock("checkpoint"):  # a round trip that changed something explains any divergence after it
            mismatches = _check_round_trip(case, obs, device)
        if mismatches:
            verdict = finding("checkpoint", mismatches)
    return _replica_first(case, obs, verdict)


def _replica_first(case: Case, obs: dict, verdict: dict) -> dict:
    """The replica oracle's finding where replicas diverged before any other
    oracle's first mismatch (a replica that drifted explains what goes wrong
    after it); at the same step the other oracle's stands (its signature names
    what it saw)."""
    found = replica_mismatches_by_step(case, obs)
    if not found:
        return verdict
    step, mismatches = found
    if verdict["status"] == Status.FINDING and verdict.get("first", {}).get("step", -1) <= step:
        return verdict
    return finding("replica", mismatches)


def replica_mismatches_by_step(case: Case, obs: dict) -> tuple[int, list[dict]] | None:
    """(step, mismatches) of the first observation whose replicas differ: a
    step's grads, then its params, state and hyperparameters, and after a
    load (step ``checkpoint.after``, quantities "loaded.*") what it gave."""
    ck = case.checkpoint
    for k, rec in enumerate(obs["steps"]):
        for key in ("replica_grads", "replica_clip", "replica_step"):
            if rec.get(key):
                return k, [{**m, "step": k} for m in rec[key]]
        if ck and k == ck.after and (obs.get("loaded") or {}).get("replica"):
            return k, [{**m, "step": k, "quantity": "loaded." + m["quantity"]} for m in obs["loaded"]["replica"]]
    return None


def _check_round_trip(case: Case, obs: dict, device: str) -> list[dict]:
    """The saved and loaded oracles (checkpoint.py) over a run's observations."""
    rec = obs["steps"][case.checkpoint.after]
    mismatches = check_saved(case, obs["saved"], rec, device) if obs["saved"] else []
    return mismatches + check_loaded(case, obs["loaded"], rec) + check_loaded_loop(case, obs.get("saved_loop"),
                                                                                   obs["loaded"].get("loop")) \
        + obs["loaded"].get("own", [])


def run_bare(case: Case, meshes, target_cls, device: str, reporter: bool, timings: dict | None = None) -> dict | None:
    """The floor ``fuzzshard bench`` measures against: the case's sharded
    training alone, as a user's loop runs it (build, shard, optimizer, then
    per step forward/backward and step), with no observation, reference or
    comparison around it. Its verdict says only whether it ran."""
    clock = Clock(timings)
    try:
        with clock("sharded"):
            if dist.get_rank() < case.world_size:
                with meshes.job(case.world_size):
                    target = target_cls(case, meshes.mesh(case.world_size, case.mesh_shape))
                    model, _ = _sharded_model(meshes, target, case, case.seed, device, flags=())
                    opt = target.optimizer(model)
                    loop = target.loop(opt, model)
                    nothing = dict  # the same steps as a checked run, observing nothing
                    with target.uneven(model, opt, nothing, nothing, lambda rec: None) as runs:
                        mine = [k for k in range(len(case.schedule)) if runs(k)]
                        _steps(meshes, case, target, model, opt, loop, mine, device, keep=False, trace=None,
                               phase=lambda kind, name: None, out=[], observe_grads=nothing, observe_step=nothing,
                               observe_clipped=lambda norm: {})
    except Exception as e:
        return invalid(f"bare run raised: {error_record(e)['text']}")
    return passing() if reporter else None


class Clock:
    """Seconds per part of a case (``timings``: name -> seconds, added up);
    a part inside another is taken out of the outer one, so the parts add up
    to the whole: bench's per-case split."""

    def __init__(self, timings: dict | None):
        self.timings = {} if timings is None else timings
        self.inner = [0.0]  # per open part: the seconds of the parts inside it

    @contextlib.contextmanager
    def __call__(self, part: str):
        t0 = time.perf_counter()
        self.inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            inside = self.inner.pop()
            self.inner[-1] += spent
            self.timings[part] = self.timings.get(part, 0.0) + spent - inside


def _ieee_float32() -> None:
    """float32 matmuls and convolutions in float32 on a GPU too: cuDNN's
    default TF32 keeps 10 mantissa bits, and the tolerances are derived for
    float32's 23 (a TF32 difference between two algorithms is no bug)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _documented_refusal(case: Case, error: dict) -> bool:
    """A strict load is refused by design when the checkpoint lacks state for
    a trainable param (the message names StateDictOptions(strict=False)), or
    when the model state dict misses or adds keys, as load_state_dict(strict=True)."""
    ck = case.checkpoint
    if ck is None or not ck.strict or error["phase"] != "checkpoint load":
        return False
    return bool(ck.missing or ck.unexpected) or error["message"].startswith("Missing optimizer state for parameter")


def _fails_before_save(case: Case, verdict: dict) -> bool:
    return verdict["status"] == Status.FINDING and verdict["first"].get("step", -1) <= case.checkpoint.after


class _Phase:
    """What is running, for the error record: its text, and the kind a
    signature names (said here, so rewording a phase never moves a signature)."""
    name, kind = "shard", "shard"
    # a pool worker's phase file (worker.py): the kind is written at its start, so the driver reads where a
    # rank that hangs or dies was (a hang's or crash's signature names this kind, never a fuzzshard module)
    sink: int | None = None

    def __init__(self) -> None:
        self("shard", "shard")

    def __call__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        if _Phase.sink is not None:
            os.pwrite(_Phase.sink, kind.encode().ljust(8), 0)


def report_phases(path: str) -> None:
    """Write the kind of each phase a case enters at the start of file ``path``
    (a pool worker's, beside its log): what the driver reads of a rank that hangs or dies."""
    _Phase.sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _run_sharded(case: Case, meshes, target_cls, device: str, keep: bool, localize: bool = False,
                 ckpt_dir: str | None = None, clock: Clock | None = None):
    """(observations, None) or (None, error record). Collectives need every rank
    to gather in the same order, so all ranks gather and only ``keep`` stores."""
    clock = clock or Clock(None)
    ck = case.checkpoint
    rank = dist.get_rank()
    phase = _Phase()
    obs = {"steps": [], "saved": None, "loaded": None}
    try:
        if rank < case.world_size:
            with meshes.job(case.world_size):
                with clock("mesh"):
                    target = target_cls(case, meshes.mesh(case.world_size, case.mesh_shape))
                model, obs["init"] = _sharded_model(meshes, target, case, case.seed, device, flags=())
                phase("ctor", "optimizer constructor")
                opt = target.optimizer(model)
                loop = target.loop(opt, model)
                phase("other", "gather initial optimizer state")
                with clock("gathers"):
                    obs["init_state"] = target.optimizer_state(opt, model)  # some optimizers fill state in __init__
                last = ck.after if ck else len(case.schedule) - 1
                obs["steps"] += _train(meshes, case, target, model, opt, loop, range(last + 1), device, keep, localize,
                                       phase, clock)
                if ck:
                    phase("save", "checkpoint save")
                    with clock("checkpoint"):
                        obs["saved"] = target.save(model, opt, ckpt_dir, meshes.group(case.world_size))
                        # the scheduler's and scaler's state beside them (a DCP Stateful or torch.save)
                        obs["saved_loop"] = loop.save(ckpt_dir, ck.kind, meshes.group(case.world_size))
        if ck:
            phase("other", "checkpoint barrier")
            dist.barrier(group=meshes.group(case.ranks))  # the files are complete
            if rank < ck.world_size:
                with meshes.job(ck.world_size):
                    _resume(case, meshes, target_cls, device, keep, localize, ckpt_dir, phase, clock, obs)
        return (obs if keep else None), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # what was observed up to a load that went through stays: a step that raises after it may be its face
        seen = obs if keep and obs["loaded"] is not None else None
        return seen, {**error_record(e), "phase": phase.name, "stage": phase.kind}


def _resume(case: Case, meshes, target_cls, device: str, keep: bool, localize: bool, ckpt_dir: str, phase,
            clock: Clock, obs: dict) -> None:
    """The loading side: a fresh model (another init) and optimizer (every lr
    halved) on the loading world, the load, then the remaining steps; into
    ``obs`` as they are seen (``loaded`` before the steps: a step may raise)."""
    ck = case.checkpoint
    phase("load", "checkpoint load: shard")
    # the loading side's optimizer holds the groups the saved one held
    added_at = case.optim.added_at if case.optim.added_at > ck.after else 0
    lcase = dataclasses.replace(case, world_size=ck.world_size, mesh_shape=ck.mesh_shape,
                                target_options=ck.target_options,
                                optim=dataclasses.replace(case.optim, added_at=added_at))
    with clock("mesh"):
        target = target_cls(lcase, meshes.mesh(ck.world_size, ck.mesh_shape))
    model, fresh = _sharded_model(meshes, target, case, case.seed + 1, device, flags=case.schedule[:ck.after + 1])
    opt = target.optimizer(model, lr_scale=RESUME_LR_SCALE)
    loop = target.loop(opt, model)  # built before the load, as torchtitan builds its schedulers
    phase("load", "checkpoint load")
    with clock("checkpoint"):
        target.load(model, opt, ckpt_dir, meshes.group(ck.world_size))
        loaded_loop = loop.load(ckpt_dir, ck.kind, meshes.group(ck.world_size))
    phase("load", "checkpoint load: gather")
    with clock("gathers"), gather_batch(meshes.batchable) as batch:
        loaded = {"params": target.params(model), "fresh": {n: fresh[n] for n in ck.missing},
                  "state": target.optimizer_state(opt, model), "groups": target.group_hparams(opt)}
        # what a load gives every replica is a copy of one checkpoint: compared whatever the device
        loaded["replica"] = batch.watch({k: loaded[k] for k in ("params", "state", "groups")})
    loaded["loop"] = loaded_loop
    if keep:
        obs["loaded"] = loaded
    obs["steps"] += _train(meshes, lcase, target, model, opt, loop, range(ck.after + 1, len(case.schedule)), device,
                           keep, localize, phase, clock)
    phase("other", "checkpoint: the target's own round-trip checks")
    loaded["own"] = target.round_trip_mismatches()  # (ddp's PowerSGD state)


def _sharded_model(meshes, target, case: Case, seed: int, device: str, flags) -> tuple:
    """(the sharded model, its initial params): requires_grad as ``case.frozen``
    and then the ``flags`` steps leave it, set after sharding, or before it
    for a target that registers the trainable params when it wraps (DDP)."""
    model = meshes.made_alike(lambda: build_model(case.model, seed, device, getattr(torch, target.build_dtype())))
    init = {n: p.detach().to(torch_dtype(case)).clone() for n, p in model.named_parameters()}

    def set_flags(m):
        target.set_requires_grad(m, case.frozen, False)
        for step in flags:
            target.apply_flags(m, step)

    if target.freeze_before_shard:
        set_flags(model)
    model = target.shard(model)
    if not target.freeze_before_shard:
        set_flags(model)
    if moe_configs_of(case.model):  # its MoE layers learn the data-parallel groups (kernel/moe.py)
        wire(model, target.batch_groups(), case.batch)
    return model, init


def _train(meshes, case: Case, target, model, opt, loop, steps, device: str, keep: bool, localize: bool, phase,
           clock: Clock) -> list[dict]:
    """Run schedule steps ``steps``; the record of each when ``keep``."""
    trace = Trace(model, target.full_activation, target.full_activation_grad, target.trace_points(case),
                  replicas=True) if localize and target.localizable and not ac_uses(case) else None
    out = []
    loop.every_rank = True  # its found_inf observed as every rank's (the reference compares each with its own)

    compared = target.replica_quantities(device)
    # an MoE routing bias to observe: its gather (an all_gather_object a step) only where a layer has one
    biased = any(c.get("bias_coeff") is not None for c in moe_configs_of(case.model))

    def observe_grads() -> dict:  # collectives over the job, after backward
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            # a fused kernel's divergence is told apart by the layout of the grads it read
            layout = {"noncontig": target.noncontiguous_grads(model)} if case.optim.implementation == "fused" else {}
            rec = {"grads": target.grads(model), "grad_spread": target.grad_spreads(model), **layout}
            rec["replica_grads"] = batch.watch({k: rec[k] for k in ("grads",) if k in compared})
        return rec

    def observe_clipped(norm) -> dict:  # collectives over the job, after clipping
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            rec = {"clipped": target.grads(model), "clip_norm": norm}
            # every rank's copy of the total norm is the same number (a user logs and clips by it)
            rec["replica_clip"] = batch.watch({"clip_norm": {"": norm}} if norm is not None else {})
        return rec

    def observe_step() -> dict:  # collectives over the job, after the step
        with clock("gathers"), gather_batch(meshes.batchable) as batch:
            rec = {"params": target.params(model), "state": target.optimizer_state(opt, model),
                   "groups": target.group_hparams(opt), "loop": loop.observe()}
            watched = [k for k in ("params", "state", "groups") if k in compared] + (["loop"] if rec["loop"] else [])
            rec["replica_step"] = batch.watch({k: rec[k] for k in watched})
        if biased:  # every MoE's routing bias, as its ranks hold it: one value, every copy the same (kernel/moe.py)
            rec["expert_bias"], replicas = observe_biases(model, meshes.group(case.world_size), len(out))
            rec["replica_step"] = list(rec["replica_step"] or []) + replicas
        return rec

    with target.uneven(model, opt, observe_grads, observe_step, out.append if keep else lambda rec: None) as runs:
        mine = [k for k in steps if runs(k)]
        _steps(meshes, case, target, model, opt, loop, mine, device, keep, trace, phase, out, observe_grads,
               observe_step, observe_clipped)
        if len(mine) < len(steps):  # the target's uneven inputs: the rest of the steps are shadowed on leaving
            phase("other", "joined: shadowing the other ranks' steps (uneven inputs)")
    if trace:
        trace.remove()
    return out


def _steps(meshes, case: Case, target, model, opt, loop, steps, device: str, keep: bool, trace, phase, out: list,
           observe_grads, observe_step, observe_clipped) -> None:
    moe = bool(moe_configs_of(case.model))
    for k in steps:
        step = case.schedule[k]
        target.apply_flags(model, step)
        if adds_groups_before(case, k):
            phase("other", f"step {k}: add_param_group")
            target.add_groups(opt, model)
        phase("other", f"step {k}: zero_grad")
        opt.zero_grad(set_to_none=step.set_to_none)
        phase("fwdbwd", f"step {k}: forward/backward")
        x, y = meshes.made_alike(lambda: make_batch(case.model, case.seed, k, case.batch, case.seq, device,
                                                    torch_dtype(case)))
        target.scale_loss = loop.scale_loss(k)  # the grad scaler's, else None
        draw_from(case, k, target.dropout_rank(), device)  # dropout: this rank's masks from its seed (dropout.py)
        if moe and loop.scaler:  # an aux loss's grad is scaled as the loss is (kernel/moe.py _AuxLoss)
            set_aux_grad(model, loop.scale_kwargs()["scale"])
        try:
            full_loss = target.forward_backward(model, x, y)
        finally:
            target.scale_loss = None
        traced = trace.take() if trace else None
        if loop.scaler:
            if loop.partial(k):  # an overflow in some grads only: on the ranks that hold its element
                phase("step", f"step {k}: a non-finite grad in {loop.partial(k).param}")
                loop.inject(k, model)
            phase("step", f"step {k}: scaler.unscale_")
            loop.unscale()
        phase("other", f"step {k}: gather grads")
        grads = observe_grads()
        clipped = {}
        if case.clip:
            phase("clip", f"step {k}: clip grads ({case.clip.how})")
            norm = loop.clip(list(model.parameters()))
            phase("other", f"step {k}: gather clipped grads")
            clipped = observe_clipped(norm)
        if moe:  # the routing bias from the step's expert counts, summed over the data-parallel ranks (torchtitan's
            # optimizer pre-hook; here on every step, before the optimizer's, on both sides)
            phase("step", f"step {k}: MoE expert_bias update")
            # through its module's attribute, where a planted bug swaps it (a flattened repro's module is __main__:
            # an aliased relative import cannot be flattened)
            sys.modules[update_expert_bias.__module__].update_expert_bias(model, target.batch_groups())
        phase("step", f"step {k}: optimizer.step")
        if loop.used:  # through the scaler, then the scheduler's step
            loop.step(full_loss)
        else:
            opt.step()
        phase("other", f"step {k}: gather params and state")
        rec = {"loss": full_loss.detach().clone(), **grads, **clipped, **observe_step(), "trace": traced}
        if keep:
            out.append(rec)
