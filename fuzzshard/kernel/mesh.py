"""Process groups and meshes for one case, the same in the pool and in a repro.

A case of world size W runs on ranks 0..W-1 of a larger world (the pool, or
torchrun with as many ranks as the case's larger side when it reshards).
Subgroups are created once, by every rank, in one order: creating them per
case deadlocks once ranks have made different numbers of groups. Each case
gets fresh DeviceMeshes over those groups, and ``job(w)`` makes ranks 0..w-1
the default group for the phase that runs on them, so torch code that uses
the default group (DCP, broadcast_from_rank0) sees a job of exactly w ranks.

A pool that runs cases side by side (runner.Pool.run_many) places a case on
ranks o..o+W-1 instead: ``placed(o, W)`` makes those ranks the world the case
sees, ranks 0..W-1 by every name torch has for a rank, so the case runs as it
would on ranks 0..W-1 and as its repro runs it under torchrun.

``World`` is the seam between the kernel and where its ranks run: what
kernel/run.py asks of the ``meshes`` it is handed. ``Meshes`` here is the
world of real process groups (one rank a process); kernel/simulated.py's
``SimulatedWorld`` runs every rank of a case in one process under
LocalTensorMode (``fuzz --simulate``) behind the same interface.
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


def rank_sets(size: int, placed: bool = False) -> list[tuple[int, ...]]:
    """Every rank set a case on ``size`` ranks can need as a mesh dim or a job
    (0..w-1 is the 1-D mesh of w), in a fixed order; ``placed``: on ranks
    o..o+w-1 too, for every offset o that fits."""
    out = set()
    for w in range(1, size + 1):
        for o in range(size - w + 1 if placed else 1):
            for shape in mesh_shapes(w, 3):
                for dim in _slices(shape):
                    out.update(tuple(r + o for r in s) for s in dim)
    return sorted(out, key=lambda s: (len(s), s))


class World:
    """What kernel/run.py asks of the world a case runs in. The mesh part:
    ``placed(offset, n)`` (the case's world while it runs), ``group(w)``,
    ``mesh(w, shape)`` and ``job(w)`` (ranks 0..w-1 as the default group
    around what they run). The hooks below have the defaults of real process
    groups, where each rank is a process of its own; a world that runs several
    ranks in one process (kernel/simulated.py) says otherwise."""

    def made_alike(self, make):
        """What every rank makes alike (the model before sharding, a step's
        batch), each from the same seed: ``make()`` on each rank, here."""
        return make()

    def observed(self, obs):
        """What the reporting rank holds of the sharded run's observations ``obs`` (None: none kept)."""
        return obs

    def batchable(self, t) -> bool:
        """Whether gather.py may fold ``t``'s full copy into its one batched all-gather
        (``gather_batch(allowed=...)``); else it is gathered on its own (``full_tensor()``)."""
        return True

    @contextlib.contextmanager
    def placed(self, offset: int, n: int):
        yield

    def group(self, w: int):
        raise NotImplementedError

    def mesh(self, w: int, shape: tuple[int, ...]):
        raise NotImplementedError

    @contextlib.contextmanager
    def job(self, w: int):
        yield


class Meshes(World):
    """Every subgroup a case can need, created collectively once."""

    def __init__(self, size: int, device_type: str, placed: bool = False):
        self.device_type = device_type
        self.groups = {ranks: dist.new_group(list(ranks)) for ranks in rank_sets(size, placed)}
        self.offset = 0  # the case's rank 0 in the real world (placed())

    def group(self, w: int):
        return self.groups[tuple(range(self.offset, self.offset + w))]

    def mesh(self, w: int, shape: tuple[int, ...]):
        """A fresh DeviceMesh over ranks 0..w-1 (never init_device_mesh, which
        would take the whole world)."""
        from torch.distributed.device_mesh import DeviceMesh

        me, o = dist.get_rank(), self.offset  # the rank in the case's own world (placed())
        dim_groups = [self.groups[tuple(r + o for r in next(s for s in dim if me in s))] for dim in _slices(shape)]
        ranks = torch.arange(w).view(*shape)
        if len(dim_groups) == 1:
            mesh = DeviceMesh.from_group(dim_groups[0], self.device_type, mesh=ranks)
        else:
            names = tuple(f"d{i}" for i in range(len(dim_groups)))
            mesh = DeviceMesh.from_group(dim_groups, self.device_type, mesh=ranks, mesh_dim_names=names)
        if o:
            # DTensor caches sharding decisions by mesh equality, and a cached spec keeps the first mesh
            # object, its groups and this process's coordinate in it: torch takes both to be the same in
            # any equal mesh. A placed mesh has the same rank map as one at offset 0 but other groups and
            # coordinates, so it carries its offset in the one part of the key meant for several ranks
            # of one process (threaded process groups). Its submeshes would not: 2-D meshes are never
            # placed (runner.placeable).
            mesh._thread_id = ("fuzzshard-offset", o)
        return mesh

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

    @contextlib.contextmanager
    def placed(self, offset: int, n: int):
        """Ranks offset..offset+n-1 as the whole world, ranks 0..n-1, while a
        case runs there: the default group is theirs, and every group's map from
        global to group ranks is shifted down by ``offset``, so what torch says
        or takes as a global rank (get_rank(), a DeviceMesh's ranks, DCP's
        coordinator, a broadcast's src) is the case's own. Offset 0 changes
        nothing: the case's world is already ranks 0..n-1 there."""
        if offset == 0:
            yield
            return
        from torch.distributed import distributed_c10d as c10d

        ranks = c10d._world.pg_group_ranks
        saved = {g: ranks[g] for g in self.groups.values() if g in ranks}
        saved_pg = c10d._world.default_pg
        for g, m in saved.items():
            ranks[g] = {r - offset: gr for r, gr in m.items()}
        self.offset = offset
        c10d._world.default_pg = self.group(n)
        try:
            yield
        finally:
            c10d._world.default_pg = saved_pg
            self.offset = 0
            ranks.update(saved)
