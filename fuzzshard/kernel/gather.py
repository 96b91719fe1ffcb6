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
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from ..versions import shard_size_and_offset

_OPEN_GATHER: list = []  # the open batch, if any (at most one)


@contextlib.contextmanager
def gather_batch():
    """Full copies asked for inside are gathered together when the block
    ends; nobody may read them before. A collective: every rank of the job
    opens and closes it at the same point."""
    b = _GatherBatch()
    _OPEN_GATHER.append(b)
    try:
        yield
    finally:
        _OPEN_GATHER.pop()
    b.flush()


def full_batched(t: torch.Tensor, fallback) -> torch.Tensor:
    """A full plain copy of DTensor ``t``: an empty tensor filled when the
    open batch ends, where ``t`` can be batched; else ``fallback(t)`` now."""
    b = _OPEN_GATHER[-1] if _OPEN_GATHER else None
    if b is None or not _gather_batchable(t):
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
    def __init__(self):
        self.items = []  # (dtensor, dest, fallback)
        self.dests = set()  # id() of every dest (items keeps them alive): what owned_copy() must not copy

    def add(self, t, fallback) -> torch.Tensor:
        dest = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        self.items.append((t, dest, fallback))
        self.dests.add(id(dest))
        return dest

    def flush(self) -> None:
        by_mesh: dict = {}  # in first-seen order: the same on every rank
        for item in self.items:
            by_mesh.setdefault(item[0].device_mesh, []).append(item)
        for mesh, items in by_mesh.items():
            _gather_shards(mesh, items)


GATHER_ALIGN = 16  # every shard's bytes start at a multiple of this: a uint8 slice views as any dtype


def _gather_aligned(nbytes: int) -> int:
    return -(-nbytes // GATHER_ALIGN) * GATHER_ALIGN


def _gather_shards(mesh, items: list) -> None:
    """Every shard of ``items`` from every rank of the 1-D ``mesh``, in one
    all-gather of bytes; each rank then assembles every full tensor."""
    group, n, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    plans = []  # per item: its shard dim and, per coordinate, (offset, length) along it and bytes
    for t, _, _ in items:
        d = t.placements[0].dim
        row_bytes = t.element_size() * math.prod(t.shape[:d]) * math.prod(t.shape[d + 1:])
        shards = [shard_size_and_offset(t.shape[d], n, c) for c in range(n)]
        plans.append((d, [(offset, length, length * row_bytes) for length, offset in shards]))
    # a row: a flag per item (1: this rank's shard is not what its spec says), then every shard's bytes
    head = _gather_aligned(len(items))
    width = head + max(sum(_gather_aligned(per[c][2]) for _, per in plans) for c in range(n))
    row = torch.zeros(width, dtype=torch.uint8, device=items[0][1].device)
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
