"""Full copies of many DTensors in one collective.

An observation after a step needs a full copy of every param, grad and
state tensor: one ``full_tensor()`` each is one all-gather each, and on CPU
the collective's fixed cost is most of it. Inside ``gather_batch()``, a
target's ``full`` hands out an empty tensor of the global shape and files the
local shard; when the block ends, every rank all-gathers the bytes of all its
shards at once and each full tensor is assembled in place. Only pure data
movement is batched (a Shard placement on a 1-D mesh), so a batched copy is
bit for bit what ``full_tensor()`` gives; a replicated tensor needs no
collective, and a Partial (a sum, whose order is the collective's), a
strided shard, a shard off the mesh's device or a 2-D mesh keep
``full_tensor()``. A rank whose shard is not the size or dtype its spec says
(a torch bug this tool exists to see) flags it in the same collective, and
every rank then gathers that one as before.

The replica oracle rides on the same pass: ``batch.watch(observation)`` has
every rank's full copies of that observation (grads, params, optimizer state,
param-group hyperparameters) compared across all the ranks of the job when
the batch ends. Each rank holds its own copy of what is replicated (a
``Replicate`` mesh dim's local tensor, HSDP's replica, FSDP1's and ZeRO's
whole params), and every copy must be the same. A copy assembled from one
all-gather over every rank of the job is the same bytes everywhere by
construction and is left out; of the others each rank digests every value
(a sum and a position-weighted sum of its bytes, its byte count) and sends
five int64 for the whole observation (how many values, a CRC of their names,
the digests summed by place), in the rows of that all-gather where a mesh of
the batch spans the job, else in one small all-gather. Only where those
differ are the per-value digests gathered, and the values that differ whole,
so the report says which ranks differ, where and by how much
(oracles.compare_replicas).
"""
from __future__ import annotations

import contextlib
import math
import sys
import zlib

import torch
import torch.distributed as dist

from ..versions import shard_size_and_offset
from .oracles import compare_replicas

_OPEN_GATHER: list = []  # the open batch, if any (at most one)


@contextlib.contextmanager
def gather_batch(allowed=None):
    """Full copies asked for inside are gathered together when the block
    ends; nobody may read them before. A collective: every rank of the job
    opens and closes it at the same point. ``allowed(t)``: the world's say on
    whether ``t`` may be batched (kernel/mesh.py, ``World.batchable``); by
    default every tensor that is pure data movement is."""
    b = _GatherBatch(allowed)
    _OPEN_GATHER.append(b)
    try:
        yield b
    finally:
        _OPEN_GATHER.pop()
    b.flush()


def full_batched(t: torch.Tensor, fallback) -> torch.Tensor:
    """A full plain copy of DTensor ``t``: an empty tensor filled when the
    open batch ends, where ``t`` can be batched; else ``fallback(t)`` now."""
    b = _OPEN_GATHER[-1] if _OPEN_GATHER else None
    if b is None or not (b.allowed(t) and _gather_batchable(t)):
        return fallback(t)
    return b.add(t, fallback)


def owned_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy the record owns: a batched full copy already is one."""
    b = _OPEN_GATHER[-1] if _OPEN_GATHER else None
    if b is not None and id(t) in b.dests:
        return t
    return t.detach().clone()


def _gather_batchable(t) -> bool:
    """A DTensor sharded on one dim of a 1-D mesh, on the mesh's device: pure data movement."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1 and type(t.placements[0]) is Shard
            and t.device.type == t.device_mesh.device_type)


class _GatherBatch:
    def __init__(self, allowed=None):
        self.allowed = allowed or (lambda t: True)
        self.items = []  # (dtensor, dest, fallback)
        self.dests = set()  # id() of every dest (items keeps them alive): what owned_copy() must not copy
        self.everywhere = set()  # id() of dests assembled from an all-gather over the whole job: the same bits everywhere
        self.watched = []  # (observation, the list its replica mismatches go into)

    def add(self, t, fallback) -> torch.Tensor:
        dest = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        self.items.append((t, dest, fallback))
        self.dests.add(id(dest))
        return dest

    def flush(self) -> None:
        by_mesh: dict = {}  # in first-seen order: the same on every rank
        for item in self.items:
            by_mesh.setdefault(item[0].device_mesh, []).append(item)
        # a mesh over every rank of the job (the default group is the job's: mesh.Meshes.job) gives the same
        # bits everywhere, and its all-gather carries the replica summaries: no collective of their own
        spans = [m for m in by_mesh if m.size() == dist.get_world_size()]
        compared = bool(self.watched) and dist.get_world_size() > 1  # one rank holds the only copy
        carrier = spans[-1] if spans and compared else None
        for mesh in spans:
            self.everywhere.update(id(dest) for _, dest, _ in by_mesh[mesh])
        for mesh, items in by_mesh.items():
            if mesh is not carrier:
                _gather_shards(mesh, items)
        if not compared:
            return
        prepared = [_replica_digests(obs, self.everywhere) for obs, _ in self.watched]  # every copy filled by now
        summaries = torch.cat([p[2] for p in prepared])
        if carrier is not None:
            table = _gather_shards(carrier, by_mesh[carrier], extra=summaries)
        else:
            table = _all_gather_int64(summaries, None)
        for (_, out), (values, digests, _), seen in zip(self.watched, prepared, table.split(SUMMARY_WORDS, dim=1)):
            out.extend(_replica_compare(values, digests, seen, None))

    def watch(self, observation: dict) -> list:
        """Compare every rank's copies in ``observation`` when the batch ends;
        returns the list the mismatches go into (filled on the lowest rank only)."""
        out: list = []
        self.watched.append((observation, out))
        return out


GATHER_ALIGN = 16  # every shard's bytes start at a multiple of this: a uint8 slice views as any dtype


def _gather_aligned(nbytes: int) -> int:
    return -(-nbytes // GATHER_ALIGN) * GATHER_ALIGN


def _gather_shards(mesh, items: list, extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every shard of ``items`` from every rank of the 1-D ``mesh``, in one
    all-gather of bytes; each rank then assembles every full tensor. ``extra``
    (int64) rides in the same rows: returned as [ranks, len(extra)], every
    rank's, in the mesh's group rank order."""
    group, n, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    plans = []  # per item: its shard dim and, per coordinate, (offset, length) along it and bytes
    for t, _, _ in items:
        d = t.placements[0].dim
        row_bytes = t.element_size() * math.prod(t.shape[:d]) * math.prod(t.shape[d + 1:])
        shards = [shard_size_and_offset(t.shape[d], n, c) for c in range(n)]
        plans.append((d, [(offset, length, length * row_bytes) for length, offset in shards]))
    # a row: a flag per item (1: this rank's shard is not what its spec says), ``extra``, then every shard's bytes
    flags = _gather_aligned(len(items))
    extra_bytes = extra.numel() * 8 if extra is not None else 0
    head = flags + _gather_aligned(extra_bytes)
    width = head + max(sum(_gather_aligned(per[c][2]) for _, per in plans) for c in range(n))
    row = torch.zeros(width, dtype=torch.uint8, device=items[0][1].device)
    if extra_bytes:
        row[flags:flags + extra_bytes] = extra.to(row.device).view(torch.uint8)
    at = head
    for i, ((t, _, _), (d, per)) in enumerate(zip(items, plans)):
        local, nbytes = t.to_local(), per[me][2]
        if local.dtype != t.dtype or local.numel() * local.element_size() != nbytes:
            row[i] = 1
        elif nbytes:
            row[at:at + nbytes] = local.detach().contiguous().view(-1).view(torch.uint8)
        at += _gather_aligned(nbytes)
    table = torch.empty(n * width, dtype=torch.uint8, device=row.device)
    dist.all_gather_into_tensor(table, row, group=group)
    table = table.view(n, width)
    rows = [dist.get_group_rank(group, int(r)) for r in mesh.mesh.tolist()]  # coordinate -> its row
    bad = table[:, :len(items)].any(dim=0).tolist()
    starts = [head] * n
    for i, ((t, dest, fallback), (d, per)) in enumerate(zip(items, plans)):
        for c in range(n):
            offset, length, nbytes = per[c]
            if not bad[i] and nbytes:
                shape = list(t.shape)
                shape[d] = length
                src = table[rows[c], starts[c]:starts[c] + nbytes].view(t.dtype).view(shape)
                dest.narrow(d, offset, length).copy_(src)
            starts[c] += _gather_aligned(nbytes)
        if bad[i]:  # as without the batch: its own full_tensor(), on every rank, in item order
            got = fallback(t)
            dest.resize_(got.shape).copy_(got)
    if extra_bytes:
        return table[:, flags:flags + extra_bytes].contiguous().view(torch.int64).cpu()
    return None


# ---- the replica oracle: every rank's copy of a value, compared ----------

def observed_values(observation: dict) -> list[tuple[str, str, object]]:
    """(quantity, fqn, value) of every replicated value an observation holds,
    in an order every rank shares: grads, params, optimizer state tensors,
    param-group hyperparameters (the names the parity oracle gives them)."""
    out = []
    for fqn, g in sorted((observation.get("grads") or {}).items()):
        out.append(("grad", fqn, g))
    for fqn, p in sorted((observation.get("params") or {}).items()):
        out.append(("param", fqn, p))
    for fqn, st in sorted((observation.get("state") or {}).items()):
        out += [(f"state.{k}", fqn, v) for k, v in sorted(st.items())]
    for i, group in enumerate(observation.get("groups") or []):
        out += [(f"param_groups.{k}", f"group {i}", v) for k, v in sorted(group.items())]
    # the training loop's (kernel/loop.py): the total grad norm, the grad scaler's scale, the scheduler's lrs
    for fqn, v in sorted((observation.get("clip_norm") or {}).items()):
        out.append(("clip_norm", fqn, v))
    for key, v in sorted((observation.get("loop") or {}).items()):
        out.append((f"loop.{key}", "", v))
    return out


def replica_mismatches(observation: dict, skip=frozenset(), group=None) -> list[dict]:
    """Every rank's copy of every value in ``observation`` against the lowest
    rank's: a collective over ``group`` (the job's default group), every rank
    with the same values in the same order. Mismatch records on the lowest
    rank (oracles.compare_replicas), [] elsewhere. ``skip``: id() of tensors
    known to be the same bits on every rank. (Inside ``gather_batch``,
    ``watch`` does this in the batch's own all-gather.)"""
    values, digests, summary = _replica_digests(observation, skip)
    return _replica_compare(values, digests, _all_gather_int64(summary, group), group)


def _replica_digests(observation: dict, skip) -> tuple:
    """(values, their digests, the observation's summary) on this rank."""
    values = [v for v in observed_values(observation) if id(v[2]) not in skip]
    digests = _digests([v for _, _, v in values])
    return values, digests, summary_digest([f"{q} {f} {_kind(v)}" for q, f, v in values], digests)


def _all_gather_int64(x: torch.Tensor, group) -> torch.Tensor:
    """[ranks, len(x)]: every rank's ``x``."""
    n = dist.get_world_size(group)
    table = torch.empty(n * x.numel(), dtype=torch.int64, device=_comm_device(group))
    dist.all_gather_into_tensor(table, x.to(table.device), group=group)
    return table.view(n, -1).cpu()


def _replica_compare(values: list, digests: torch.Tensor, summaries: torch.Tensor, group) -> list[dict]:
    """Where every rank's summary is this one's, nothing; else (rare) every
    rank's names and digests, then only the values that differ, whole."""
    n = dist.get_world_size(group)
    if n == 1 or bool((summaries == summaries[0]).all()):
        return []
    every = _all_gather_objects([((q, f), (_kind(v), d)) for (q, f, v), d in zip(values, digests.tolist())], group)
    keys = sorted({k for held in every for k, _ in held}, key=lambda k: (k[0] != "grad", k))
    held = [dict(h) for h in every]
    differ = [k for k in keys if any(h.get(k) != held[0].get(k) for h in held)]
    mine = {(q, f): v for q, f, v in values}
    copies = _all_gather_objects([_portable(mine.get(k)) for k in differ], group)
    return _compared(group, differ, copies)


def _all_gather_objects(obj, group) -> list:
    """Every rank's ``obj``, in group rank order (``dist.all_gather_object``).
    Under LocalTensorMode (``--simulate``: every rank of the job in this
    process) each rank's ``obj`` is here already, its LocalTensors and per-rank
    ints (a LocalTensor's ``tolist()``) holding every rank's own: rank r's
    ``obj`` is that with rank r's, as a real rank would have sent it."""
    lt = sys.modules.get("torch.distributed._local_tensor")  # never imported: no LocalTensorMode
    mode = lt.enabled_local_tensor_mode() if lt is not None else None
    if mode is None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, obj, group=group)
        return every
    ranks = dist.get_process_group_ranks(group) if group is not None else sorted(mode.ranks)
    with mode.disable():  # what each rank holds: plain tensors, as a real rank's
        return [_on_rank(obj, r, lt.LocalTensor) for r in ranks]


def _on_rank(x, r: int, local_tensor: type):
    """``x`` as simulated rank ``r`` holds it: each LocalTensor its tensor on ``r``, each per-rank int its int."""
    if isinstance(x, local_tensor):
        return x._local_tensors[r]
    if isinstance(x, torch.SymInt):
        ints = getattr(x.node, "_local_ints", None)  # a LocalIntNode; a ConstantIntNode is one int for all
        return ints[r] if ints is not None else x.node.maybe_as_int()
    if isinstance(x, (list, tuple)):
        return type(x)(_on_rank(v, r, local_tensor) for v in x)
    if isinstance(x, dict):
        return {k: _on_rank(v, r, local_tensor) for k, v in x.items()}
    return x


SUMMARY_WORDS = 5  # int64 an observation's summary takes


def summary_digest(names: list[str], digests: torch.Tensor) -> torch.Tensor:
    """Five int64 for a whole observation, the same length on every rank: how
    many values, the CRC of their names and kinds (a rank holding other values
    has diverged too), and their digests summed, each weighted by its place
    (one value that changes changes the sum)."""
    weights = torch.arange(1, 2 * len(names) + 1, 2, dtype=torch.int64).unsqueeze(1)
    total = (digests * weights).sum(0) if len(names) else torch.zeros(DIGEST_WORDS, dtype=torch.int64)
    head = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64)
    return torch.cat([head, total])


def _compared(group, keys: list, every: list) -> list[dict]:
    """On the lowest rank: compare_replicas of each (quantity, fqn) in ``keys``,
    ``every[r][j]`` rank r's copy of the j-th."""
    if dist.get_rank(group) != 0:
        return []
    out = []
    for j, (quantity, fqn) in enumerate(keys):
        m = compare_replicas(quantity, -1, fqn, {r: copies[j] for r, copies in enumerate(every)})
        if m is not None:
            out.append(m)
    return out


def _kind(v) -> str:
    """What a value is, for the names every rank must share (not its contents)."""
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{tuple(v.shape)}"
    return "none" if v is None else type(v).__name__


def _comm_device(group) -> torch.device:
    """Where the group's collectives take tensors: NCCL's on this rank's GPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _portable(v):
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


DIGEST_WORDS = 3  # per value: sum of its bytes, their position-weighted sum, its byte count


def _digests(values: list) -> torch.Tensor:
    """[len(values), 3] int64: a tensor's bytes summed plainly and weighted by
    their position (a drift, a swap or a scale changes one of them; equal
    bytes give equal digests), its byte count; a None, -1s; anything else (a
    hyperparameter) the CRC of its repr. Tensors are digested together per
    device: their bytes in one cat, then two index_adds."""
    out = torch.zeros(len(values), DIGEST_WORDS, dtype=torch.int64)
    by_device: dict = {}
    for i, v in enumerate(values):
        if v is None:
            out[i] = -1
        elif isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i, 0] = zlib.crc32(repr(v).encode())
    for device, idx in by_device.items():
        raw = [values[i].detach().contiguous().view(-1).view(torch.uint8) for i in idx]
        counts = torch.tensor([r.numel() for r in raw], device=device)
        flat = torch.cat(raw).to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(idx), device=device), counts)
        pos = torch.arange(flat.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[seg]
        sums = torch.zeros(2, len(idx), dtype=torch.int64, device=device)
        sums[0].index_add_(0, seg, flat)
        sums[1].index_add_(0, seg, flat * (pos % 65521 + 1))  # below 2^24 a byte: no overflow under 2^39 bytes
        out[idx, :2] = sums.t().cpu()
        out[idx, 2] = counts.cpu()
    return out
