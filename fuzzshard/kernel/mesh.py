"""Process groups and meshes for one case, the same in the pool and in a repro.

A case of world size W runs on ranks 0..W-1 of a larger world (the pool, or
torchrun with as many ranks as the case's larger side when it reshards).
Subgroups are created once, by every rank, in one order: creating them per
case deadlocks once ranks have made different numbers of groups. Each case
gets fresh DeviceMeshes over those groups, and ``job(w)`` makes ranks 0..w-1
the default group for the phase that runs on them, so torch code that uses
the default group (DCP, broadcast_from_rank0) sees a job of exactly w ranks.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from ..case import mesh_shapes


def _slices(shape: tuple[int, ...]) -> list[list[list[int]]]:
    """Per mesh dim, the rank lists of the 1-D slices along it."""
    ranks = torch.arange(math.prod(shape)).view(*shape)
    return [ranks.movedim(d, -1).reshape(-1, shape[d]).tolist() for d in range(len(shape))]


def rank_sets(size: int) -> list[tuple[int, ...]]:
    """Every rank set a case on ``size`` ranks can need as a mesh dim or a job
    (0..w-1 is the 1-D mesh of w), in a fixed order."""
    out = set()
    for w in range(1, size + 1):
        for shape in mesh_shapes(w):
            for dim in _slices(shape):
                out.update(tuple(s) for s in dim)
    return sorted(out, key=lambda s: (len(s), s))


class Meshes:
    """Every subgroup a case can need, created collectively once."""

    def __init__(self, size: int, device_type: str):
        self.device_type = device_type
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in rank_sets(size)}

    def group(self, w: int):
        return self.groups[tuple(range(w))]

    def mesh(self, w: int, shape: tuple[int, ...]):
        """A fresh DeviceMesh over ranks 0..w-1 (never init_device_mesh, which
        would take the whole world)."""
        from torch.distributed.device_mesh import DeviceMesh

        me = dist.get_rank()
        dim_groups = [self.groups[tuple(next(s for s in dim if me in s))] for dim in _slices(shape)]
        ranks = torch.arange(w).view(*shape)
        if len(dim_groups) == 1:
            return DeviceMesh.from_group(dim_groups[0], self.device_type, mesh=ranks)
        names = tuple(f"d{i}" for i in range(len(dim_groups)))
        return DeviceMesh.from_group(dim_groups, self.device_type, mesh=ranks, mesh_dim_names=names)

    @contextlib.contextmanager
    def job(self, w: int):
        """Ranks 0..w-1 as the default group, as if torchrun had started w ranks."""
        from torch.distributed import distributed_c10d as c10d

        saved = c10d._world.default_pg
        c10d._world.default_pg = self.group(w)
        try:
            yield
        finally:
            c10d._world.default_pg = saved
