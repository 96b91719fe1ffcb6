"""Name the module behind a loss or grad divergence.

Each traced output (and its grad) is compared with the reference's and, in
the sharded run, across the ranks: every rank's full copy is the whole
tensor as the reference has it (``Target.full_activation``: a ``Replicate``
DTensor's local tensor, TP's whole plain activation, a gathered batch), so
they must agree. A copy that one rank holds otherwise was made wrong by the
op that wrote it, though the reporting rank's copy may be right and the
divergence reach the reference only through a later module that reads the
bad copy (a Conv1d that labels an unreduced output ``Replicate``, read by a
head sharded on its input dim)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .gather import _comm_device, _digests, _portable
from .model import plain_fqn
from .oracles import compare, compare_replicas

PHASES = ("fwd", "bwd")


class Trace:
    """Records each traced module's output (forward order) and the grad of
    that output (backward order), as full tensors. Used only to name the first
    diverging module once a loss or grad divergence is known: it decides no
    verdict, so its tolerance cannot cause a false positive.

    ``points``: which modules, by plain FQN (Target.trace_points); None: every
    leaf. ``full(t, fqn)`` / ``full_grad(g, fqn)``: the whole-batch plain
    tensor of a module's output or its grad, as the reference has it.
    ``replicas``: the sharded run's trace, on every rank of the job: ``take``
    then also gathers every rank's copy of each entry that differs between
    ranks (a collective over the job's default group)."""

    def __init__(self, model, full, full_grad, points=None, replicas: bool = False):
        self.full, self.full_grad, self.replicas, self.handles = full, full_grad, replicas, []
        self._clear()
        seen = set()
        for name, mod in model.named_modules():
            fqn = plain_fqn(name)
            if not name or fqn in seen or not (points(fqn) if points else not list(mod.children())):
                continue
            seen.add(fqn)  # a wrapper and the module it wraps share a plain FQN: the outer one is traced
            kind = type(mod).__name__
            kind = kind[4:] if kind.startswith("FSDP") else kind  # fully_shard renames the class
            kind = type(getattr(mod, "_checkpoint_wrapped_module", mod)).__name__ if kind == "CheckpointWrapper" else kind
            self.handles.append(mod.register_forward_hook(self._hook(fqn, kind)))

    def _clear(self):
        # fwd: (name, kind, copy); bwd: (name, kind, copy, index of its output in fwd);
        # outs: the traced output objects (kept alive, so an id() names one); readers: fwd index -> its readers
        self.fwd, self.bwd, self.outs, self.readers = [], [], [], {}

    def _hook(self, name, kind):
        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                return
            at = len(self.fwd)
            made = {id(t): i for i, t in enumerate(self.outs)}
            for i in sorted({made[id(a)] for a in tree_leaves(args) if id(a) in made}):
                self.readers.setdefault(i, []).append(at)
            self.fwd.append((name, kind, self.full(out, name).detach().clone()))
            self.outs.append(out)
            if out.requires_grad:
                out.register_hook(lambda g: self.bwd.append((name, kind, self.full_grad(g, name).detach().clone(), at)))

        return hook

    def take(self):
        out = {"fwd": self.fwd, "bwd": self.bwd, "readers": self.readers}
        if self.replicas:
            out["replicas"] = differing_copies(out)
        self._clear()
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def differing_copies(traced: dict, group=None) -> dict:
    """{phase: {index: {rank: copy}}} of every traced tensor whose copies
    differ between the ranks of ``group`` (the job's default group): a
    collective, the lowest rank's answer filled, {} elsewhere. A digest per
    copy first (gather.py's), whole copies only where digests differ; ranks
    whose traces differ in length cannot be lined up and compare nothing."""
    entries = [(phase, i, e[2]) for phase in PHASES for i, e in enumerate(traced[phase])]
    simulated = _simulated_copies(entries)
    if simulated is not None:
        return simulated
    n = dist.get_world_size(group)
    if n == 1:
        return {}
    device = _comm_device(group)
    head = torch.tensor([len(traced[p]) for p in PHASES], dtype=torch.int64)
    heads = torch.empty(n * len(PHASES), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(heads, head.to(device), group=group)
    heads = heads.view(n, len(PHASES)).cpu()
    if not bool((heads == heads[0]).all()) or not entries:
        return {}
    mine = _digests([t for _, _, t in entries])
    table = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, mine.reshape(-1).to(device), group=group)
    table = table.view(n, *mine.shape).cpu()
    differ = [j for j in range(len(entries)) if not bool((table[:, j] == table[0, j]).all())]
    if not differ:
        return {}
    every = [None] * n
    dist.all_gather_object(every, [_portable(entries[j][2]) for j in differ], group=group)
    if dist.get_rank(group) != 0:
        return {}
    out: dict = {}
    for k, j in enumerate(differ):
        phase, i, _ = entries[j]
        out.setdefault(phase, {})[i] = {r: copies[k] for r, copies in enumerate(every)}
    return out


def _simulated_copies(entries: list) -> dict | None:
    """Under torch's LocalTensorMode (a simulated run, one process for every
    rank) each copy is one LocalTensor holding every rank's: all of them, as
    {phase: {index: {rank: copy}}}, with no collective (the fake group's
    refuse plain tensors); None outside that mode."""
    try:
        from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
    except ImportError:  # torch < 2.10: no simulation
        return None
    if enabled_local_tensor_mode() is None:
        return None
    out: dict = {}
    for phase, i, t in entries:
        if isinstance(t, LocalTensor):
            out.setdefault(phase, {})[i] = {r: t._local_tensors[r] for r in sorted(t._local_tensors)}
    return out


def localize_divergence(got: dict, want: dict, tol: dict) -> dict | None:
    """The first module whose output diverges (forward order), else the first
    whose output grad diverges (backward order): the module that consumed
    that output computed a wrong input grad, and is named. Diverges: the
    reporting rank's copy differs from the reference's, or the ranks' copies
    differ from each other (``got["replicas"]``, the same tolerance)."""
    replicas = got.get("replicas") or {}
    for phase in PHASES:
        for i, (mine, theirs) in enumerate(zip(got[phase], want[phase])):
            name, kind, g = mine[:3]
            if name != theirs[0]:
                break  # the call orders differ: cannot localise further
            quantity = "forward" if phase == "fwd" else "backward"
            m = compare(quantity, -1, name, g, theirs[2], tol)
            if m is None and i in replicas.get(phase, {}):
                m = compare_replicas(quantity, -1, name, replicas[phase][i], tol)
            if m:
                what = "output" if phase == "fwd" else "output grad"
                m["detail"] = f"{what} of {name} ({kind}): {m['detail']}"
                if phase == "bwd":
                    name, kind = _reader(got, i)
                    m["fqn"], m["detail"] = name, f"{m['detail']}, from the backward of {name} ({kind})"
                m["module"] = kind
                return m
    return None


def _reader(got: dict, i: int) -> tuple[str, str]:
    """(name, kind) of the module whose backward made bwd entry ``i``, the grad
    of some module's output: the one traced module that read that output in
    forward; else (an untraced op between them, several readers) the module
    whose output grad came just before in backward order; else (the loss read
    it) the module itself."""
    name, kind, _, at = got["bwd"][i]
    readers = got.get("readers", {}).get(at, [])
    if len(readers) == 1:
        return got["fwd"][readers[0]][:2]
    if i > 0:
        return got["bwd"][i - 1][:2]
    return name, kind
