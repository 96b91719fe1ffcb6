"""A straight-line standalone repro: only what one finding uses, written out.

``straight_script(case, headline, environment, verdict)`` writes a short
torch-only script for ``torchrun``: the model as explicit nn modules, the
target's own calls, the optimizer with the kwargs that differ from torch's
defaults, the steps, the checkpoint's save and load, and then only the check
that the finding failed (``verdict``: the oracle, the step, the quantity):
  - an error (and a crash or a hang): the run up to where it raised, and
    nothing else: torch's own traceback is the evidence;
  - a checkpoint round trip: the state right before the save and right after
    the load, compared exactly;
  - parity: a plain copy of the model takes the sharded run's params and
    optimizer state before the step (anchored, as kernel/reference.py does),
    runs the step on the whole batch and steps from the sharded grads; the
    difference beyond the kernel's rounding bound (kernel/oracles.py) printed;
  - a replica divergence: after each step (and the load) every rank's copy of the
    quantity that diverged (grads, params, an optimizer state, a group's hyperparameter)
    gathered, and the ranks holding each copy and how far apart printed (bit for bit);
  - no verdict (a case, not a finding): parity at every step, or the round trip.
Cases it cannot write return None (``fallback_reason`` says why): repro.script falls
back to the flattened kernel and says so. The case's device and backend are one
variable (``device``: cpu with gloo, cuda with NCCL, one GPU per rank); the decoder
transformer is written out; a plugin's optimizer or model comes from the user's
plugin file, imported by the path the finding recorded (``environment["plugins"]``).
The training loop a case draws (kernel/loop.py: grad scaler, clip, LR scheduler, their
state beside the checkpoint) is written in torch's words on both sides (loop.py;
dtensor, tp, fsdp2, zero, pp and fsdp1: FSDP's own clip_grad_norm_).

Per-target knowledge lives in one module per target here, found as targets are
(``writer``): scriptgen/NAME.py writes target NAME's cases, as kernel/targets/NAME.py
is target NAME (fuzzshard/targets.py); the helpers they share (common.py, dsd.py: the
state-dict checkpoint kinds, loop.py: the training loop) are ``_NOT_WRITERS``. Not a
hook in each target's Spec: the kernel's target modules are flattened into every
fallback repro and imported in every worker, and this is driver-only text generation
that would weigh on both. A new target's writer is one module here, nothing else:
``unsupported(case, options)`` (why a case is not written, or None) and ``KINDS``
(the checkpoint kinds it writes) at the least, and for what it writes imports, shard,
optimizer, forward_backward, snapshot, grads and FREEZE_BEFORE_SHARD; the checkpoint
kinds of its own as save_<kind> / load_<kind>; REPLICAS where its snapshot lacks some
replicated quantities; ``objective(case, net, x)`` where the plain replay's loss is not
the loss on the whole batch (fsdp2's non-root term, pp's microbatches); LOOP (it
writes the training loop around the step), DTENSOR_GRADS (its grads are DTensors: a
total norm made full), SHARDED_SCALER (its grad scaler is ShardedGradScaler; SCALER_GROUP
the group it names), OWN_CLIP (the clip "own" is the model's clip_grad_norm_),
``global_loss(case, world)`` (ReduceLROnPlateau's loss where its ranks hold slices),
``grads_def(case, options)`` (the lines its grads expression calls) and
``joined_steps(case, options)`` (steps under Join: zero's uneven inputs).
A target with no module here falls back to the flattened kernel, saying so.
"""
from __future__ import annotations

import functools
import importlib
import math
import pkgutil
import re
import textwrap

import torch

from ..case import Case
from .. import targets
from ..kernel import dropout
from ..kernel.model import BUILTIN_MODELS, USER_MODELS, param_shapes, reused_unit_params
from ..kernel.oracles import UNIT_ROUNDOFF, mixed_precision_tolerance, reduction_tolerance
from ..kernel.reference import reduction_length, reduction_parts, step_tolerance_for  # the kernel's bounds
from . import common, dsd, loop
from .. import oracle as oracles  # what a finding of each oracle is
from ..verdict import Verdict

# scriptgen/NAME.py is the writer of target NAME's scripts: adding one is adding its module (as
# kernel/targets/NAME.py is target NAME). Not writers: the helpers the writers share.
_NOT_WRITERS = {"common", "dsd", "loop", "sync"}
_WRITTEN = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_WRITERS)


@functools.lru_cache(maxsize=None)
def writer(target: str):
    """The module that writes ``target``'s scripts, or None (its repro is the flattened kernel)."""
    if target not in _WRITTEN:
        return None
    module = importlib.import_module(f"{__name__}.{target}")
    if not (callable(getattr(module, "unsupported", None)) and hasattr(module, "KINDS")):
        raise TypeError(f"{module.__name__} must define unsupported(case, options) and KINDS, as every writer does")
    return module


def writers() -> dict:
    """Every writer found: target name -> its module."""
    return {name: writer(name) for name in _WRITTEN}



def straight_script(case: Case, headline: str = "", environment: dict | None = None,
                    verdict: Verdict | None = None) -> str | None:
    """The script's text (exit 0: torch behaves; 1: the finding shows), or None
    where the case uses something no writer here writes (``fallback_reason``)."""
    if fallback_reason(case, environment, verdict):
        return None
    return Writer(case, writer(case.target), _plan(case, verdict), headline, environment or {}).text()


def fallback_reason(case: Case, environment: dict | None = None, verdict: Verdict | None = None) -> str | None:
    """Why the straight-line script cannot be written (the flattened kernel is then the repro); None: it can."""
    w = writer(case.target)
    if w is None:
        return f"no straight-line writer for the target {case.target}"
    why = _unsupported(case, w, environment or {})
    if why:
        return why
    plan = _plan(case, verdict)
    if isinstance(plan, str):  # (_plan writes errors, checkpoint round trips, replicas, and parity after a load)
        return plan
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    if plan["mode"] != "error" and case.model.factory == "decoder" and any(o.get("tp") for o in sides):
        # (written for an error's run: a clean case's grads under it differ from the plain replay's by ~0.2%
        # where the kernel's run passes, not yet understood)
        return "TP of the decoder transformer (torchtitan's plan) outside an error's run"
    if plan["mode"] == "replica":
        q = plan["quantity"]
        if q.split(".")[0] not in getattr(w, "REPLICAS", ("grad", "param", "state", "param_groups", "clip_norm", "loop")):
            return f"{case.target}'s replicas of {q} are not observable"
        if q == "grad" and w.grads(case, case.target_options) is None:
            return f"{case.target}'s grads are not observable under these options"
    checked = case.checkpoint.target_options if plan.get("resumed") else case.target_options  # (the side checked)
    if plan["mode"] in ("parity", "checkpoint", "replica") and w.snapshot(case, checked) is None:
        return f"{case.target}'s full state is not observable under these options"
    if plan["mode"] in ("parity", "all") and dropout.mode(case) == "replay" and (
            case.target_options.get("mp") or case.dtype in ("bfloat16", "float16")):
        return "dropout's replay under mixed precision or a low-precision sensitivity probe"
    if dropout.mode(case) == "replay" and case.checkpoint:
        t, ck = targets.get(case.target), case.checkpoint
        if (t.dropout_world(case.target_options, case.world_size), t.microbatches(case.target_options)) != \
                (t.dropout_world(ck.target_options, ck.world_size), t.microbatches(ck.target_options)):
            return "dropout's replay over another data-parallel split after the load"
    if plan["mode"] != "parity":
        return None
    if w.grads(case, checked) is None:
        return f"{case.target}'s grads are not observable under these options"
    if case.target_options.get("mp") and (case.target_options.get("tp") or case.target_options.get("nonroot")):
        return "parity under mixed precision with TP or a non-root forward"
    if plan["what"] in ("", "param", "state") and "update_rel" in _step_tolerance(case):
        return "parity of a compiled optimizer step (its allowance is the kernel's, per element)"
    return None


def _unsupported(case: Case, w, env: dict) -> str | None:
    plugins = env.get("plugins") or []
    if case.model.factory and case.model.factory not in BUILTIN_MODELS and not plugins:
        return f"the plugin model {case.model.factory!r}, its file not recorded in the finding"
    if case.model.factory and case.model.factory not in BUILTIN_MODELS | USER_MODELS.keys():
        return f"the plugin model {case.model.factory!r}, not loaded here (--plugin its file)"  # (its shapes: built on meta)
    if not hasattr(torch.optim, case.optim.name) and not plugins:
        return f"the plugin optimizer {case.optim.name!r}, its file not recorded in the finding"
    if len(plugins) > 1:
        return f"{len(plugins)} plugin files"
    if not common.literal_ok(case.optim.kwargs) or not all(common.literal_ok(g.overrides) for g in case.groups):
        return "hyperparameters that are not Python literals"
    if any(layer.kind == "act" and layer.act not in common.ACTS for layer in common.walk(case.model.layers)):
        return "an activation the script does not write"
    moes = [layer.moe for layer in common.walk(case.model.layers) if layer.kind == "moe"]
    if case.model.factory == "decoder" and case.model.sizes.get("moe"):
        return "the decoder transformer with MoE blocks"
    if moes and not getattr(w, "MOE", False):
        return f"an MoE layer under {case.target} (its writer does not write one)"
    unwritten = sorted({k for cfg in moes for k in cfg} - common.MOE_WRITTEN)
    if unwritten:
        return f"an MoE with {', '.join(unwritten)} (the script's MoE is dropless, without aux loss or routing bias)"
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    for o in sides:
        why = w.unsupported(case, {k: v for k, v in o.items() if k not in ("ac", "ac_how", "ac_wrapper")}) or \
            common.ac_unsupported(case, o, w)  # activation checkpointing: common.ac_lines, every writer's
        if why:
            return f"{case.target} {why}"
        if o.get("tp") and case.model.factory and not (case.model.factory == "decoder" and getattr(w, "DECODER_TP", False)):
            return "TP of the decoder transformer (torchtitan's plan)" if case.model.factory == "decoder" else \
                f"TP of the plugin model {case.model.factory!r}"
    if case.checkpoint and case.checkpoint.kind not in w.KINDS:
        return f"the checkpoint kind {case.checkpoint.kind}"
    return loop.unsupported(case)  # the training loop around the step (scaler, clip, LR scheduler)


def _step_tolerance(case: Case) -> dict:
    """The kernel's bound of the optimizer step (reference.step_tolerance_for): the largest param's."""
    numel = max([math.prod(sh) for sh in param_shapes(case.model).values()] or [1])
    return step_tolerance_for(case, numel, targets.get(case.target))


def _plan(case: Case, verdict: Verdict | None) -> dict | str:
    """What the script runs and checks (or why it cannot: a string): mode (error, checkpoint, parity, replica,
    all), the last saving-side step, whether the loading side runs and its last step,
    whether each step observes the full state (where the kernel's gathers raised). An error's (a crash's, a
    hang's) here; a silent finding's is its oracle's ``script`` (oracle/NAME.py), these defaults updated."""
    ck, n = case.checkpoint, len(case.schedule)
    oracle, first = (verdict.oracle or "", verdict.first) if verdict else ("", None)
    save_last = ck.after if ck else n - 1
    plan = {"mode": "all", "last": save_last, "load": bool(ck), "load_last": n - 1, "observe": False, "check": "",
            "ckpt": bool(ck)}  # ckpt: whether the script saves (and loads)
    if verdict and (oracles.raised(verdict) or oracles.costly(verdict) or verdict.error and not first):
        # an error, a crash or a hang: the run up to where it raised or stopped (where the ranks did not finish,
        # observing the full state after each step as the kernel's gathers do)
        err = verdict.error_record
        phase = err.phase or ""
        plan.update(mode="error", observe=oracles.costly(verdict) or "gather" in phase, check=err.type)
        m = re.match(r"step (\d+)", phase)
        if m:
            k = int(m.group(1))
            if ck and k > ck.after:
                plan["load_last"] = k
            else:
                plan.update(last=k, load=False)
        elif phase in ("shard", "optimizer constructor", "gather initial optimizer state"):
            plan.update(last=-1, load=False)
        elif phase == "checkpoint save":
            plan["load"] = False
        elif phase.startswith("checkpoint load") or phase == "checkpoint barrier":
            plan["load_last"] = ck.after if ck else n - 1
        return plan
    # a silent finding: the script writes out its oracle's own comparison (its ``script``: docs/extending.md, An oracle)
    o = oracles.checks(case, verdict)
    if o.script is None:
        return f"a finding of the {oracle} oracle, whose check the script does not write"
    return o.script(case, verdict, plan)


class Writer:
    def __init__(self, case: Case, w, plan: dict, headline: str, env: dict):
        self.case, self.w, self.plan, self.headline, self.env = case, w, plan, headline, env
        self.ranks = case.ranks

    # ---- the parts ----------------------------------------------------------
    def text(self) -> str:
        c, p = self.case, self.plan
        body = ["fail = []  # the replicated values whose copies differ"] * (p["mode"] == "replica")
        body += self.side(c.target_options, c.world_size, c.mesh_shape, c.seed, 1.0, 0, p["last"], save=True)
        if p["ckpt"] and p["last"] >= c.checkpoint.after:
            ck = c.checkpoint
            body += ["dist.barrier()  # the checkpoint is complete", "",
                     f"# the loading side, on {ck.world_size} rank(s): a fresh model (another seed) and optimizer "
                     "(every lr halved), the load"]
            if p["load"]:
                body += self.side(ck.target_options, ck.world_size, ck.mesh_shape, c.seed + 1, 0.5, ck.after + 1,
                                  p["load_last"], save=False)
        body += self.verdict_lines()
        parts = [self.header(), self.imports(), self.prologue(), "\n".join(common.model(c, 2)), "\n".join(common.batch(c))]
        if hasattr(self.w, "definitions"):  # what the writer's shard lines call, written once for both sides (ep's)
            parts.insert(4, "\n".join(self.w.definitions(c)))
        if p["mode"] in ("parity", "checkpoint", "replica") or p["observe"]:
            parts.append("\n".join(self.w.snapshot(c, c.target_options)))
        if self.reads_grads() and hasattr(self.w, "grads_def"):  # (what a writer's grads expression calls)
            parts.append("\n".join(self.w.grads_def(c, c.target_options)))
        if p["mode"] == "replica":
            parts.append(_REPLICAS)
        if self.keep_loop():
            parts.append("\n".join(loop.PLAIN))
        if p["mode"] == "parity":
            parts.append(_CHECK.replace("{u}", f"2.0 ** {int(math.log2(UNIT_ROUNDOFF[c.dtype]))}")
                         .replace("{dtype}", c.dtype))
            if self.sensitive():
                parts.append(_SENSITIVITY.replace("LOSS", self.plain_loss("net", "xin")))
        parts += ["\n".join(body), _END]
        return "\n\n".join(x.strip("\n") for x in parts if x) + "\n"

    def own_kind(self) -> bool:
        """Whether the writer saves and loads the case's checkpoint kind itself (save_<kind> / load_<kind>: its
        own kinds, and pp's "dcp", torchtitan's per-stage checkpoint), else DSD's (dsd.py)."""
        return hasattr(self.w, "load_" + self.case.checkpoint.kind)

    def reads_grads(self) -> bool:
        """Whether the script reads the sharded run's grads (the parity replay's, a replica's, an observed step's)."""
        p = self.plan
        return p["mode"] == "parity" or p["observe"] or p["mode"] == "replica" and p["quantity"] == "grad"

    def header(self) -> str:
        c, p = self.case, self.plan
        what = {"error": "runs it and lets torch's error show", "checkpoint":
                "compares the state right before the save with the state right after the load (exactly)",
                "parity": "replays each checked step on a plain copy of the model, anchored on the sharded run's state, "
                          "and compares within rounding bounds",
                "all": "replays each step on a plain copy of the model, anchored on the sharded run's state",
                "replica": "gathers every rank's copy of the replicated "
                           f"{self.replica_label() if p['mode'] == 'replica' else ''} after each step (and the load), "
                           "which must be the same bit for bit"}[p["mode"]]
        headline = (self.headline or "a fuzzshard case").replace("\\", "/").replace('"', "'")
        plugin = f" and the plugin file it was found with ({self.env['plugins'][0]})" if self.env.get("plugins") else ""
        about = textwrap.fill(f"Needs only torch{plugin}; found with torch {self.env.get('torch', '?')}, "
                              f"{self.env.get('backend', 'gloo')}, on {c.device}. Trains the case with {c.target}"
                              f"{f' ({loop.about(c)} around each step)' if loop.used(c) else ''} "
                              f"and {what}.", 120)
        return f'#!/usr/bin/env python\n"""{headline}\n\nRun: torchrun --nproc-per-node {self.ranks} THIS_FILE.py ' \
               f'[--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)\n{about}\n"""'

    def imports(self) -> str:
        c = self.case
        out = ["import datetime, os, sys" + ", importlib.util, types" * bool(self.env.get("plugins")),
               "import torch, torch.distributed as dist, torch.nn as nn"]
        out += ["import torch.nn.functional as F"] * (c.model.factory in BUILTIN_MODELS)
        out += ["import copy"] * bool(self.plan["mode"] == "parity" and self.mixed_precision())
        own = ["import math"] * common.has_moe(c) + list(self.w.imports(c, c.target_options)) + loop.imports(c) + \
            common.ac_imports(c)  # (math: the MoE's init)
        if self.plan["ckpt"]:
            own += self.w.imports(c, c.checkpoint.target_options)
            own += ["import tempfile"] + (getattr(self.w, "imports_" + c.checkpoint.kind)(c) if self.own_kind() else
                                          dsd.imports(c) if c.checkpoint.kind in dsd.KINDS else [])
        if self.plan["mode"] in ("parity", "checkpoint", "replica") or self.plan["observe"]:
            own += getattr(self.w, "snapshot_imports", lambda: [])()
        if self.submesh(c.world_size) or (c.checkpoint and self.submesh(c.checkpoint.world_size)):
            own += ["from torch.distributed.device_mesh import DeviceMesh", "from torch.distributed import distributed_c10d as c10d"]
        return "\n".join(out + list(dict.fromkeys(own)))

    def prologue(self) -> str:
        c = self.case
        lines = ["if \"--setup\" in sys.argv:  # a Python file run first (a patch of torch, e.g. a planted bug)",
                 "    setup = sys.argv[sys.argv.index(\"--setup\") + 1]; "
                 "exec(compile(open(setup).read(), setup, \"exec\"), {\"__name__\": \"__setup__\", \"__file__\": setup})",
                 "torch.set_num_threads(1)",
                 ("device = torch.device(\"cuda\", int(os.environ[\"LOCAL_RANK\"]))  # the case's device"
                  if c.device == "cuda" else "device = torch.device(\"cpu\")  # the case's device") +
                 " (cuda: one GPU per rank, NCCL)",
                 "if device.type == \"cuda\": torch.cuda.set_device(device)",
                 "dist.init_process_group({\"cpu\": \"gloo\", \"cuda\": \"nccl\"}[device.type], "
                 "timeout=datetime.timedelta(seconds=120))  # a hang fails",
                 "rank = dist.get_rank()",
                 "sys.excepthook = lambda kind, err, tb: (  # an error anywhere below is a finding: said, then its traceback",
                 "    print(f\"FINDING: rank {rank}: {kind.__name__}: {err}\", flush=True), sys.__excepthook__(kind, err, tb), os._exit(1))"]
        if self.submesh(c.world_size) or (c.checkpoint and self.submesh(c.checkpoint.world_size)):
            lines.append("everyone = c10d._world.default_pg  # every rank: the script's world")
        if self.env.get("plugins"):
            lines += common.plugin_lines(c, self.env["plugins"][0])
        if self.plan["ckpt"]:
            lines += ["dist.broadcast_object_list(ckpt := [tempfile.mkdtemp() if rank == 0 else None])  # one directory every rank sees",
                      "ckpt = ckpt[0]"]
        return "\n".join(lines)

    def submesh(self, world: int) -> bool:
        return world < self.ranks

    def mesh(self, world: int, shape: tuple) -> str:
        names = ", mesh_dim_names=(\"d0\", \"d1\")" if len(shape) == 2 else ""
        if not self.submesh(world):
            return f"init_device_mesh(device.type, {tuple(shape)}{names})"
        return f"DeviceMesh(device.type, torch.arange({world}).view{tuple(shape)}{names})  # ranks 0..{world - 1}"

    def side(self, options: dict, world: int, shape: tuple, seed: int, lr_scale: float, first: int, last: int,
             save: bool) -> list[str]:
        """One side's model, optimizer and steps ``first..last`` (and its save, or its load)."""
        c, w, p = self.case, self.w, self.plan
        ck = c.checkpoint
        sub = self.submesh(world)  # fewer ranks than the script's: its own mesh or group, made by every rank
        group = "group" if sub else ""
        shard = w.shard(c, options, shape, "MESH", group)
        make_opt = w.optimizer(c, options, lr_scale, group)
        out = [f"# the sharded run on {world} rank(s)" + (f" of {self.ranks}" if sub else "")] if save else []
        if sub:
            out += [f"mesh = {self.mesh(world, shape)}"] * ("mesh = MESH" in shard)
            shard = [ln for ln in shard if ln != "mesh = MESH"]
        elif not save and (world, tuple(shape)) == (c.world_size, tuple(c.mesh_shape)) and "mesh = MESH" in shard \
                and self.plan["last"] >= 0:
            shard = [ln for ln in shard if ln != "mesh = MESH"]  # the saving side's mesh
        else:
            shard = [ln.replace("MESH", self.mesh(world, shape)) for ln in shard]
        inner = [f"model = build({seed})"]
        frozen = [f"for n in {list(c.frozen)!r}:  # frozen from the start", "    model.get_parameter(n).requires_grad_(False)"] \
            if c.frozen else []
        if not save:  # the loading side's params require grad as the saved run left them
            flags = [(n, False) for s in c.schedule[:ck.after + 1] for n in s.freeze] + \
                    [(n, True) for s in c.schedule[:ck.after + 1] for n in s.unfreeze]
            frozen += [f"model.get_parameter({n!r}).requires_grad_({v})" for n, v in flags]
        inner += (frozen + shard) if w.FREEZE_BEFORE_SHARD else (shard + frozen)
        inner += make_opt + loop.build(c, shape=tuple(shape))
        if save and p["check"] and hasattr(w, "check_" + p["check"]):
            inner += getattr(w, "check_" + p["check"])(c)  # the target's own check that failed
        if p["mode"] == "parity" and not p.get("resumed"):
            inner += ["got, after = [], [snapshot(model, opt)]  # per step: the grads, and the state after it"]
            inner += ["ran = []  # per step: what the loop around it gave"] * loop.used(c)
        if not save:
            load = getattr(w, "load_" + ck.kind)(c, group) if self.own_kind() else dsd.load(c, group)
            if ck.strict and (ck.missing or ck.unexpected):  # a strict load must refuse it
                load = ["try:", *common.indent(load), "    accepted = True", "except Exception as e:",
                        "    accepted = False", "    print(f\"rank {rank}: the strict load refused it: {e!r}\"[:300])"]
            inner += load + loop.load(c, group, keep=self.keep_loop())
            if p["mode"] == "checkpoint":
                inner += ["loaded = snapshot(model, opt)"]
            elif p["mode"] == "parity":  # the steps after the load, by their step: the loaded state before the first
                inner += [f"after = [None] * {ck.after + 1} + [snapshot(model, opt)]  # the loaded state: before step "
                          f"{ck.after + 1}", f"got = [dict.fromkeys(after[-1][0])] * {ck.after + 1}  # (no grads held)"]
                inner += [f"ran = [None] * {ck.after + 1}"] * loop.used(c)
            elif p["mode"] == "replica" and p["quantity"] != "grad":
                inner += self.replicas(options, "\"after the load")
            elif p["observe"]:
                inner += ["seen = snapshot(model, opt)  # the loaded params and optimizer state, gathered"]
        inner += self.steps(options, world, shape, first, last)
        if save and p["ckpt"] and last >= ck.after:
            inner += ["saved = snapshot(model, opt)"] * (p["mode"] == "checkpoint")
            inner += [f"# save after step {ck.after}"]
            inner += getattr(w, "save_" + ck.kind)(c, group) if self.own_kind() else dsd.save(c, group)
            inner += loop.save(c, group, keep=self.keep_loop())
        if sub:  # as torchrun with this side's ranks: torch code that takes the default group (DCP, DSD, FSDP) sees them
            return out + [f"group = dist.new_group(list(range({world})))", f"if rank < {world}:",
                          f"    c10d._world.default_pg = group  # ranks 0..{world - 1} as the default group (as the kernel runs it)",
                          *common.indent(inner)] + ["c10d._world.default_pg = everyone"]
        return out + inner

    def steps(self, options: dict, world: int, shape: tuple, first: int, last: int) -> list[str]:
        c, p = self.case, self.plan
        if last < first:
            return []
        # the steps recorded for the parity replay (after a load: the loading side's only)
        parity = p["mode"] == "parity" and (not p.get("resumed") or first > c.checkpoint.after)
        body = []
        for k in range(first, last + 1):  # a step's freezes and unfreezes, and groups added before it
            s = c.schedule[k]
            acts = [f"model.get_parameter({n!r}).requires_grad_(False)" for n in s.freeze] + \
                   [f"model.get_parameter({n!r}).requires_grad_(True)" for n in s.unfreeze]
            if c.optim.added_at == k and c.optim.added_groups and (k > (c.checkpoint.after if c.checkpoint else -1)
                                                                   or first == 0):
                added = common.param_groups(c)[1]
                acts += [f"for g in {added}:  # groups added mid-run", "    opt.add_param_group(g)"]
                if getattr(self.w, "added_groups", None):
                    acts += self.w.added_groups(c)
            if acts:
                body += ([f"if k == {k}:"] + common.indent(acts)) if last > first else acts
        nones = {s.set_to_none for s in c.schedule[first:last + 1]}
        if nones == {True}:
            body.append("opt.zero_grad()")
        elif len(nones) == 1:
            body.append("opt.zero_grad(set_to_none=False)")
        else:
            body.append(f"opt.zero_grad(set_to_none={[s.set_to_none for s in c.schedule]!r}[k])")
        body.append("x, y = batch(k)")
        if dropout.has_dropout(c.model):  # the kernel's seeds (kernel/dropout.py): per data-parallel rank and step
            r = "rank" if targets.get(c.target).dropout_world(options, world) > 1 else "0"
            body.append(f"torch.manual_seed(({c.seed} * 1000 + k) * 1000 + {r} + 1)  # dropout: "
                        + ("this rank's masks from its own seed" if r == "rank" else "every rank draws alike"))
        body += loop.backward(c, self.w.forward_backward(c, options, world, shape), first, last)
        body += loop.unscale(c, first=first, last=last)  # (after a partial overflow, where the case has one)
        seen_grads, mid, seen_step = [], [], []  # what each step observes after its backward, and after its step
        if parity:
            seen_grads.append(f"got.append({self.w.grads(c, options)})")
        elif p["observe"] and self.w.grads(c, options):
            seen_grads.append(f"seen = {self.w.grads(c, options)}  # the grads, gathered")
        if p["mode"] == "replica" and p["quantity"] == "grad":
            seen_grads += self.replicas(options, "f\"step {k}")
        mid += loop.clip(c)
        if p["observe"] and c.clip and self.w.grads(c, options):
            mid.append(f"seen = {self.w.grads(c, options)}  # the clipped grads, gathered")
        mid += loop.global_loss(c, world) if loop.plateau(c) else []
        mid += loop.step(c)
        if p["mode"] == "replica" and p["quantity"] != "grad":
            seen_step += self.replicas(options, "f\"step {k}")
        if parity:
            seen_step += loop.record(c, self.w.grads(c, options)) if loop.used(c) else []
            seen_step.append("after.append(snapshot(model, opt))")
        elif p["observe"]:
            seen_step.append("seen = snapshot(model, opt)  # params and optimizer state, gathered")
        joined = getattr(self.w, "joined_steps", None)  # a writer's uneven inputs (zero's: under Join)
        if joined and joined(c, options) is not None:
            return joined(c, options)(body, seen_grads, mid, seen_step, first, last)
        body += seen_grads + mid + seen_step
        if last == first:
            return [f"k = {first}"] + body
        return [f"for k in range({first}, {last + 1}):" if first else f"for k in range({last + 1}):"] + common.indent(body)

    def verdict_lines(self) -> list[str]:
        c, p = self.case, self.plan
        if p["mode"] == "error":
            return ["", "if rank == 0:", "    print(\"PASS: it ran through\")", "fail = []"]
        if p["mode"] == "checkpoint":
            return self.checkpoint_check()
        if p["mode"] == "replica":
            return ["", "if rank == 0:",
                    "    print(\"\\n\".join([\"FINDING: ranks hold different copies of a replicated value\", *fail]) if fail else",
                    f"          \"PASS: every rank holds the same {self.replica_label()} (bit for bit)\")"]
        return self.parity_check()

    def replica_label(self) -> str:
        """What the finding's quantity is, in words (param_groups.lr: "lr of each param group")."""
        kind, _, key = self.plan["quantity"].partition(".")
        return {"grad": "grads", "param": "params", "state": f"{key} of each param", "clip_norm": "total grad norm",
                "loop": {"scale": "grad scaler's scale"}.get(key, "scheduler's last lrs")}.get(kind, f"{key} of each param group")

    def replicas(self, options: dict, when: str) -> list[str]:
        """The check of every rank's copy of the finding's quantity (``when``: the label's opening, a string
        literal's start), for each param or param group."""
        q = self.plan["quantity"]
        kind, _, key = q.partition(".")
        mine = {"grad": self.w.grads(self.case, options), "param": "snapshot(model, opt)[0]",
                "state": f"{{n: v for (n, k), v in snapshot(model, opt)[1].items() if k == {key!r}}}",
                "param_groups": f"{{f\"group {{i}}\": g.get({key!r}) for i, g in enumerate(snapshot(model, opt)[2])}}",
                # the training loop's (kernel/loop.py): the total norm, the scale, the lrs
                "clip_norm": "{\"total grad norm\": norm}", "loop": "{\"scale\": scaler.get_scale()}" if key == "scale"
                else "{\"get_last_lr()\": sched.get_last_lr()}"}[kind]
        label = "" if kind in ("clip_norm", "loop") else f" {key} of" if key else f" {kind}"
        return [f"fail += replicas({when}{label}\", {mine})"]

    def checkpoint_what(self) -> str:
        """What a round trip's finding is about (param, state, group, loop; "": all of it)."""
        q = "" if self.plan.get("saved") else self.plan.get("quantity", "")
        return "param" if q.startswith("loaded.param") and not q.startswith("loaded.param_groups") else \
            "state" if q.startswith("loaded.state") else "group" if q.startswith(("loaded.group", "loaded.param_groups")) \
            else "loop" if q.startswith(("loaded.lr_scheduler", "loaded.scaler")) else ""

    def keep_loop(self) -> bool:
        """Whether the round trip checks the loop's state (the scheduler's, the scaler's) saved and loaded."""
        ck = self.case.checkpoint
        return self.plan["mode"] == "checkpoint" and loop.stateful(self.case) and not self.plan.get("saved") and \
            self.checkpoint_what() in ("", "loop") and not (ck.strict and (ck.missing or ck.unexpected))

    def checkpoint_check(self) -> list[str]:
        c, ck = self.case, self.case.checkpoint
        out = ["", "# the loaded state must equal the saved one"]
        if ck.strict and (ck.missing or ck.unexpected):
            keys = ([f"without {dsd.missing_keys(c)}"] * bool(ck.missing) + ["with an unexpected key"] * ck.unexpected)
            return out + [f"fail = [\"a strict load accepted a model state dict {' and '.join(keys)} \"",
                          "        \"(load_state_dict(strict=True) refuses it)\"] if accepted else []",
                          "if rank == 0:", "    print(f\"FINDING: {fail[0]}\" if fail else \"PASS: the strict load refused it\")"]
        if ck.missing:
            out += [f"fresh = dict(build({c.seed + 1}).named_parameters())  # a non-strict load leaves these as they were",
                    f"saved[0].update({{n: fresh[n].detach() for n in {list(ck.missing)!r}}})"]
        if self.plan.get("saved"):
            return ["", "# what was saved must equal the optimizer state it was saved from", "fail = []", "if rank == 0:",
                    "    file = torch.load(f\"{ckpt}/full.pt\")[\"optim\"][\"state\"]",
                    "    fail = [f\"saved state {n}.{k}: {torch.as_tensor(v).tolist()}, the optimizer's {saved[1][n, k].tolist()}\"",
                    "            for n, s in file.items() for k, v in s.items() if not torch.equal(torch.as_tensor(v), saved[1][n, k])]",
                    "    print(\"\\n\".join([\"FINDING: the checkpoint holds other values than the optimizer\", *fail]) if fail else",
                    "          \"PASS: the checkpoint holds the optimizer's state\")"]
        what = self.checkpoint_what()
        out += ["fail = []", "if rank == 0:  # saved and loaded: (params, optimizer state, param groups)"]
        if self.keep_loop():  # ... and the scheduler's and the scaler's state
            out += loop.check_loaded()
        if what in ("", "param"):
            out += ["    fail += [f\"param {n}: saved {v.tolist()}, loaded {loaded[0][n].tolist()}\"",
                    "             for n, v in saved[0].items() if not torch.equal(v, loaded[0][n])]"]
        if what in ("", "state"):
            out += ["    names = lambda state, n: sorted(k for m, k in state if m == n)",
                    "    fail += [f\"state of {n}: saved {names(saved[1], n)}, loaded {names(loaded[1], n)}\"",
                    "             for n in sorted({m for m, _ in saved[1]} ^ {m for m, _ in loaded[1]})]",
                    "    fail += [f\"state {n}.{k}: saved {v.tolist()}, loaded {loaded[1][n, k].tolist()}\" for (n, k), v in saved[1].items()",
                    "             if (n, k) in loaded[1] and not (v.dtype == loaded[1][n, k].dtype and torch.equal(v, loaded[1][n, k]))]"]
        if what in ("", "group"):
            out += ["    fail += [f\"param group {i} {k}: saved {g[k]!r}, loaded {g2.get(k)!r}\"",
                    "             for i, (g, g2) in enumerate(zip(saved[2], loaded[2])) for k in g if g[k] != g2.get(k)]"]
        out += ["    print(\"\\n\".join([\"FINDING: the load changed what was saved\", *fail]) if fail else",
                "          \"PASS: the loaded state equals the saved one\")"]
        return out

    def plain_loss(self, net: str, x: str) -> str:
        """The kernel's objective on the plain model: the loss, or a writer's own ``objective(case, net, x)``
        where it has one (fsdp2: its non-root forward term; pp: the schedule's microbatches)."""
        if hasattr(self.w, "objective"):
            return self.w.objective(self.case, net, x)
        return common.loss(self.case, f"{net}({x})", "y")

    def dropout_replay(self) -> list[str]:
        """kernel/dropout.py's replay: each data-parallel rank's slice, in its microbatches, from the seed that
        rank drew its masks from; the mean loss (what the averaged grads are the grads of)."""
        c = self.case
        if dropout.mode(c) != "replay" or self.plan.get("what") not in ("", "grad"):
            return []
        o = c.target_options
        world = targets.get(c.target).dropout_world(o, c.world_size)
        m, per = targets.get(c.target).microbatches(o), c.batch // world
        return [f"def replayed(net, x, batch_y, k):  # dropout: each of {world} rank(s)' slice, from its seed",
                "    total = 0",
                f"    for r in range({world}):",
                f"        torch.manual_seed(({c.seed} * 1000 + k) * 1000 + r + 1)  # the seed rank r drew its masks from",
                f"        for xm, y in zip(x[{per} * r:{per} * (r + 1)].chunk({m}), batch_y[{per} * r:{per} * (r + 1)].chunk({m})):",
                f"            total = total + {self.plain_loss('net', 'xm')} / {m}",
                f"    return total / {world}"]

    def sensitive(self) -> bool:
        """Whether the grads' bound takes the one-ulp sensitivity too, as the kernel's does: in a low precision,
        where rounding inside the forward (a norm over a near-constant row) outweighs the reductions' bound."""
        return self.plan["mode"] == "parity" and self.plan.get("what") in ("", "grad") and \
            (self.case.dtype in ("bfloat16", "float16") or bool(self.case.target_options.get("mp")))

    def mixed_precision(self) -> list[str]:
        """FSDP2's MixedPrecisionPolicy replayed with the same casts, as the kernel's reference does
        (kernel/targets/fsdp2.py mixed_precision_reference), its bound the kernel's (mixed_precision_tolerance)."""
        c, o = self.case, self.case.target_options
        mp = o.get("mp")
        if not mp or self.plan.get("what") not in ("", "grad"):
            return []
        compute = mp.get("param_dtype") or c.dtype
        reduce = mp.get("reduce_dtype") or compute
        world, m = c.world_size, o.get("microbatches", 1)
        tol, per = mixed_precision_tolerance(compute, reduce, world, m), c.batch // world
        units = ", ".join(["low"] + [self.w.module(u, c).replace("model", "low", 1) for u in o.get("wrap", [])])
        # a unit the forward calls twice: FSDP2 reduces its last microbatch's grad apart (fsdp2.split_reduced)
        split = sorted(reused_unit_params(c.model, o.get("wrap", ()))) if m > 1 else []
        box = "into" if split else "acc"
        hooks = []
        if mp.get("cast_forward_inputs", True) and mp.get("param_dtype"):
            hooks.append(f"        unit.register_forward_pre_hook(lambda m, a: tuple(t.to(torch.{compute}) "
                         "if t.is_floating_point() else t for t in a))")
        if mp.get("output_dtype"):
            hooks.append(f"        unit.register_forward_hook(lambda m, a, out: out.to(torch.{mp['output_dtype']}))")
        return [f"MP_ULPS, MP_U, MP_ETA = {tol['k_ulps']}, 2.0 ** {int(math.log2(tol['u']))}, {tol['eta']!r}  "
                f"# the kernel's bound: {tol['why']}",
                f"def mp_grads(x, y):  # each rank's slice on a copy in {compute}, its grads added in {reduce}, averaged",
                "    low = copy.deepcopy(plain)",
                "    for q in low.parameters():",
                f"        q.grad, q.data = None, q.data.to(torch.{compute})",
                *([f"    for unit in [{units}]:  # FSDP2's units: the casts at each"] + hooks if hooks else []),
                "    lp, total, spread, sens = dict(low.named_parameters()), {}, {}, {}",
                f"    for r in range({world}):",
                "        acc = {}" if not split else "        acc, apart = {}, {}",
                f"        for {'i, (xm, ym)' if split else 'xm, ym'} in {'enumerate(' * bool(split)}zip(x[{per} * r:{per} * "
                f"(r + 1)].chunk({m}), y[{per} * r:{per} * (r + 1)].chunk({m})){')' * bool(split)}:"
                + "  # its microbatches" * (m > 1),
                f"            for n, v in sensitivity(low, xm, ym{f', 1 / {m}' if m > 1 else ''}).items():",
                f"                sens[n] = sens.get(n, 0.0) + v / {world}",
                "            for q in lp.values():",
                "                q.grad = None",
                f"            ({common.loss(c, 'low(xm)', 'ym')} / {m}).backward()" if m > 1 else
                f"            {common.loss(c, 'low(xm)', 'ym')}.backward()",
                "            for n, q in lp.items():",
                *([f"                into = apart if n in {tuple(split)!r} and i == {m - 1} else acc  "
                   "# FSDP2 reduces a twice-called unit's last microbatch apart"] if split else []),
                f"                if q.grad is not None and n in {box}:",
                f"                    {box}[n] += q.grad  # accumulated in place, rounded once per add",
                "                elif q.grad is not None:",
                f"                    {box}[n] = q.grad.to(torch.{reduce})",
                "                if q.grad is not None:",
                "                    spread[n] = spread.get(n, 0) + q.grad.double().abs()",
                "        for n, g in acc.items():" if not split else "        for n, g in [*acc.items(), *apart.items()]:",
                "            total[n] = total.get(n, 0) + g.double()",
                f"    return ({{n: (v / {world}).to(torch.{c.dtype}) for n, v in total.items()}}, sens,",
                f"            {{n: MP_ULPS * MP_U * v / {world} for n, v in spread.items()}})"]

    def parity_check(self) -> list[str]:
        c, p = self.case, self.plan
        red, step = reduction_tolerance(c.dtype, reduction_length(c)), _step_tolerance(c)  # the kernel's bounds
        per = reduction_tolerance(c.dtype, 1)["k_ulps"]  # the kernel's ulps per summed term
        if c.model.factory or per * reduction_length(c) != red["k_ulps"]:
            red_k = str(red["k_ulps"])
        else:  # as its factors: ulps per term, batch, seq, widest dim, conv kernel, depth + 1
            red_k = " * ".join(map(str, (per, *reduction_parts(c))))
        step_u = "U" if step["u"] == UNIT_ROUNDOFF[c.dtype] else f"2.0 ** {int(math.log2(step['u']))}"
        what = p.get("what", "")
        plain = [f"GRAD_ULPS = {red_k}  # the kernel's bound: {red['why']}"] * \
            (what in ("", "grad") and not c.target_options.get("mp") or what in ("", "clip") and bool(c.clip))
        plain += [f"STEP_ULPS, STEP_U = {step['k_ulps']}, {step_u}  # the kernel's bound: {step['why']}"] * \
            (what not in ("grad", "clip"))
        plain += ["plain = build(%d)" % c.seed]
        if c.frozen:
            plain += [f"for n in {list(c.frozen)!r}:", "    plain.get_parameter(n).requires_grad_(False)"]
        opt = [ln.replace("model.", "plain.").replace("opt = ", "opt_p = ").replace("opt.add", "opt_p.add")
               for ln in common.optimizer(c)]
        opt += loop.build(c, "opt_p", "sched_p", "scaler_p", sharded=False) if what not in ("grad", "clip") else []
        steps = p["steps"]
        over = [k for k in c.scaler.overflow if k in steps] if c.scaler else []
        if over:  # an overflow step's grads are inf: none to compare (as the kernel)
            guard = lambda lines: [f"if k not in {over!r}:  # the loss overflowed: its grads are inf"] + common.indent(lines) \
                if len(steps) > 1 else [] if steps[0] in over else lines
        else:
            guard = lambda lines: lines
        body = []
        for k in steps:
            acts = [f"plain.get_parameter({n!r}).requires_grad_(False)" for n in c.schedule[k].freeze] + \
                   [f"plain.get_parameter({n!r}).requires_grad_(True)" for n in c.schedule[k].unfreeze]
            if c.optim.added_at == k and c.optim.added_groups:
                acts += [f"for g in {common.param_groups(c)[1]}:", "    opt_p.add_param_group(g)"]
            if acts:
                body += ([f"if k == {k}:"] + common.indent(acts)) if len(steps) > 1 else acts
        anchor = ["params, state, _ = after[k]  # the sharded run's state before step k",
                  "pp = dict(plain.named_parameters())",
                  "with torch.no_grad():",
                  "    for n, q in pp.items():",
                  "        q.copy_(params[n])",
                  "        q.grad = got[k - 1][n].clone() if k and got[k - 1][n] is not None else None",
                  "opt_p.state.clear()",
                  "for (n, name), v in state.items():",
                  "    opt_p.state[pp[n]][name] = v.clone() if v.dim() or name != \"step\" else v.clone().cpu()"]
        body += anchor if steps != [0] else []
        sn = [st.set_to_none for st in c.schedule]
        if what in ("", "grad") and c.target_options.get("mp"):
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)", "new, sens, extra = mp_grads(x, y)",
                     "want = {n: q.grad if n not in new else new[n] if q.grad is None else q.grad + new[n]  # FSDP2 adds to a held grad",
                     "        for n, q in plain.named_parameters()}",
                     *guard(["fail += [check(f\"step {k} grad {n}\", got[k][n], want[n], MP_ULPS, MP_U, sens.get(n, 0.0) + "
                             "MP_ETA, extra.get(n, 0.0)) for n in want]"])]
        elif what in ("", "grad") and dropout.mode(c) == "replica":
            body += ["# dropout on DTensor activations: torch promises no mask equal to the plain model's on this device,",
                     "# so the loss and grads are not compared (the step from the sharded grads is)"]
        elif what in ("", "grad") and dropout.mode(c) == "replay":
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)", "replayed(plain, x, y, k).backward()  # every rank's slice, from its seed"]
            body += loop.overflow_plain(c, steps)
            body += guard(["fail += [check(f\"step {k} grad {n}\", got[k][n], q.grad, GRAD_ULPS)  # summed in another order",
                           "         for n, q in plain.named_parameters()]"])
        elif what in ("", "grad"):
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)",
                     f"{self.plain_loss('plain', 'x')}.backward()  # {getattr(self.w, 'BATCH', 'the whole batch')}"]
            sens = ", sens=sens.get(n, 0.0)" if self.sensitive() else ""
            body += ["sens = sensitivity(plain, x, y)"] * bool(sens)
            body += loop.overflow_plain(c, steps)
            body += guard([f"fail += [check(f\"step {{k}} grad {{n}}\", got[k][n], q.grad, GRAD_ULPS{sens})"
                           "  # summed in another order", "         for n, q in plain.named_parameters()]"])
        replayed, loop_checks = loop.replay(c, what) if loop.used(c) else ([], [])
        if what != "grad":
            if not (c.scaler and what != "clip"):  # (the scaler's replay sets them, scaled)
                body += ["with torch.no_grad():  # the plain optimizer steps from the sharded grads: only the step differs",
                         "    for n, q in plain.named_parameters():",
                         "        q.grad = got[k][n]"]
            body += replayed or ["opt_p.step()"]
        if what not in ("grad", "clip"):
            body += ["(params, state, groups), mine = after[k + 1], snapshot(plain, opt_p)"]
        if what in ("", "param"):
            body += [f"fail += [check(f\"step {{k}} param {{n}}\", params[n], v, STEP_ULPS, STEP_U) for n, v in mine[0].items()]"]
        if what in ("", "state"):
            body += [f"fail += [check(f\"step {{k}} state {{n}} {{s}}\", state.get((n, s)), mine[1].get((n, s)), STEP_ULPS, STEP_U)",
                     "         for n, s in sorted(set(state) | set(mine[1]))]"]
        if what in ("", "group"):
            body += ["if groups != mine[2]:",
                     "    fail.append(f\"step {k} param_groups: sharded {groups}, plain {mine[2]}\")"]
        body += loop_checks
        run = [f"k = {steps[0]}"] + body if len(steps) == 1 else [f"for k in {steps!r}:"] + common.indent(body)
        run += loop.same_norm() if what in ("", "clip") and c.clip and c.clip.how != "value" else []
        run += loop.same_scale(c) if what in ("", "loop") else []
        return ["", "# the plain model replays the step on the whole batch from the sharded run's state",
                *plain, *opt, *self.mixed_precision(), *self.dropout_replay(), "fail = []", *run, "fail = [f for f in fail if f]",
                "if rank == 0:",
                "    print(\"\\n\".join([\"FINDING: the sharded run differs from the plain one\", *fail]) if fail else",
                "          \"PASS: the sharded run matches the plain one\")"]


_CHECK = '''U = {u}  # unit roundoff of {dtype}

def check(what, got, want, k, u=U, sens=0.0, extra=0.0):  # None if |got - want| <= k ulps of (max|want| + |want|) + k sens + extra
    if got is None or want is None or got.shape != want.shape:
        return None if got is None and want is None else f"{what}: sharded {got}, plain {want}"
    g, w, fin = got.double(), want.double(), got.isfinite() & want.isfinite()
    if not (fin | (g == w) | (g.isnan() & w.isnan())).all():
        return f"{what}: NaN or inf in one run only"
    g, w = g.where(fin, 0), w.where(fin, 0)
    err, bound = (g - w).abs(), k * u * (w.abs().max() + w.abs()) + k * sens + extra
    if (ok := err <= bound).all():
        return None
    i = int((err - bound).where(~ok, -1).argmax())
    return (f"{what}: sharded {g.flatten()[i].item():.8g}, plain {w.flatten()[i].item():.8g} at flat index {i}, "
            f"|diff| {err.flatten()[i].item():.3g} > allowed {bound.flatten()[i].item():.3g} ({int((~ok).sum())}/{w.numel()} off)")'''

_SENSITIVITY = '''def sensitivity(net, x, y, scale=1.0):  # per grad: its largest move under one-ulp nudges of every param and input
    g, pp = torch.Generator().manual_seed(1234), dict(net.named_parameters())  # (as kernel/plain.py measures it)
    saved, held, out = {n: q.detach().clone() for n, q in pp.items()}, {n: q.grad for n, q in pp.items()}, {}
    nudge = lambda t: torch.nextafter(t, torch.where(torch.rand(t.shape, generator=g).to(t.device) < 0.5, float("inf"), float("-inf")).to(t.dtype))
    def run(nudged):
        with torch.no_grad():
            for n, q in pp.items():
                q.copy_(nudge(saved[n]) if nudged else saved[n])
                q.grad = None
        xin = nudge(x) if nudged and x.is_floating_point() else x
        (LOSS * scale).backward()
        return {n: q.grad for n, q in pp.items()}
    base = run(False)
    for _ in range(4):  # one draw can read 0 by chance
        out.update({n: max(out.get(n, 0.0), float((v - base[n]).abs().max())) for n, v in run(True).items()
                    if v is not None and base[n] is not None and v.numel()})
    with torch.no_grad():
        for n, q in pp.items():
            q.copy_(saved[n])
            q.grad = held[n]
    return out'''


_REPLICAS = '''def off(a, b):  # None where b is a copy of a bit for bit (NaN equals NaN, -0.0 equals 0.0), else how far apart
    if not (torch.is_tensor(a) and torch.is_tensor(b)):  # a hyperparameter, or a copy one rank lacks
        same = not torch.is_tensor(a) and not torch.is_tensor(b) and (a == b or a != a and b != b)
        return None if same else f"{b!r} vs {a!r}"[:200]
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{b.dtype}{tuple(b.shape)} vs {a.dtype}{tuple(a.shape)}"
    x, y = a.double(), b.double()
    d = (x - y).abs().where((x != y) & ~(x.isnan() & y.isnan()), 0)
    bad = int((d != 0).sum())
    return f"max abs diff {d.max().item():.3g} ({bad}/{d.numel()} elements)" if bad else None

def replicas(what, mine):  # every rank's copy of each value in mine, gathered: which ranks hold which copy, how far apart
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: v.detach().cpu() if torch.is_tensor(v) else v for n, v in mine.items()})
    out = []
    for n in dict.fromkeys(k for e in every for k in e):
        copies, held = [e.get(n) for e in every], {}  # held: a copy's lowest rank: the ranks holding that copy
        for r, v in enumerate(copies):
            held.setdefault(next((h for h in held if off(copies[h], v) is None), r), []).append(r)
        out += [f"{what} {n}: ranks {' vs '.join(map(str, held.values()))}: " +
                "; ".join(f"rank {h}'s copy vs rank 0's: {off(copies[0], copies[h])}" for h in list(held)[1:])] * (len(held) > 1)
    return out'''


_END = '''sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there'''
