"""The script's text, part by part: ``straight_script`` and the Writer, which writes the header, the imports,
the prologue (the process group, the setup file, the checkpoint's directory), each side's run (the sharded run;
after a checkpoint, the loading side) and its steps, then the check (checks.py, the Writer's other half).

What each part holds comes from the plan (plan.py) and the target's writer module (``self.w``, registry.py);
the model, the batch and the optimizer are common.py's, the training loop around the step loop.py's.
"""
from __future__ import annotations

import math
import textwrap

from ..case import Case
from .. import targets
from ..kernel import dropout
from ..kernel.model import BUILTIN_MODELS
from ..kernel.oracles import UNIT_ROUNDOFF
from . import common, dsd, loop
from .checks import CHECK_FN, REPLICAS_FN, SENSITIVITY_FN, Checks
from .plan import fallback_reason, plan_of
from .registry import writer
from ..verdict import Verdict


def straight_script(case: Case, headline: str = "", environment: dict | None = None,
                    verdict: Verdict | None = None) -> str | None:
    """The script's text (exit 0: torch behaves; 1: the finding shows), or None
    where the case uses something no writer here writes (``fallback_reason``)."""
    if fallback_reason(case, environment, verdict):
        return None
    return Writer(case, writer(case.target), plan_of(case, verdict), headline, environment or {}).text()


class Writer(Checks):
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
            parts.append(REPLICAS_FN)
        if self.keep_loop():
            parts.append("\n".join(loop.PLAIN))
        if p["mode"] == "parity":
            parts.append(CHECK_FN.replace("{u}", f"2.0 ** {int(math.log2(UNIT_ROUNDOFF[c.dtype]))}")
                         .replace("{dtype}", c.dtype))
            if self.sensitive():
                parts.append(SENSITIVITY_FN.replace("LOSS", self.plain_loss("net", "xin")))
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


_END = '''sys.stdout.flush()
dist.barrier()  # rank 0 has printed: a rank's failing exit makes torchrun stop the others, rank 0's print with them
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there'''
