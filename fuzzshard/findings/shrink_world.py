"""The reducer's edits of a case's world (reduce.py's EDITS): fewer ranks, a mesh of fewer dims, a smaller
batch and sequence, float32.

A smaller world keeps some of the mesh's dims: fewer ranks on a 1-D mesh (the target's options fitted to it,
Spec.fit_options: dtensor keeps the first dim's placements), and, on a mesh of more dims (no checkpoint),
every smaller mesh that keeps some of its dims, each at most its size (the target's options projected onto
those dims first, Spec.project_options: dtensor keeps those dims' placements), the fewest ranks first; then
the 1-D mesh of the same world. A simulated session's findings shrink through these same edits
(onset.least_worlds): a bug that lives on a 2-D mesh's second dim reaches a 1-D mesh of that dim."""
from __future__ import annotations

import copy
import itertools
import math
from typing import Iterator

from .edit import Edit, changed_copy, smaller_sizes

MESH_PARTS = "; "  # between the parts of what a world edit does ("world size 16 -> 6; mesh [2, 8] -> [6]")


def target_class(target: str):
    """``target``'s class; the base class's defaults for a target no longer registered."""
    from .. import targets
    from ..kernel.targets.base import Target

    return targets.get(target) if target in targets.names() else Target


def spec(target: str):
    """``target``'s Spec (kernel/targets/base.py)."""
    return target_class(target).spec


def fit_options(target: str, options: dict, mesh: list, n_steps: int) -> dict:
    """Target options that name mesh dims or ranks, fitted to another mesh (the target's Spec.fit_options)."""
    out, fit = copy.deepcopy(options), spec(target).fit_options
    return fit(out, mesh, n_steps) if fit else out


def batch_unit(data: dict) -> int:
    """What the batch must be a multiple of: a data-parallel target gives every
    rank of either side an equal slice, in equal microbatches (as strategies draw it)."""
    if not spec(data["target"]).data_parallel:
        return 1
    ck = data["checkpoint"]
    sides = [data["target_options"]] + ([ck["target_options"]] if ck else [])
    split = target_class(data["target"]).microbatches
    return math.lcm(data["world_size"], ck["world_size"] if ck else 1) * max(split(o) for o in sides)


def seq_unit(data: dict) -> int:
    """What the sequence length must be a multiple of (the target's Spec.seq_multiple), on either side."""
    multiple = spec(data["target"]).seq_multiple
    if not multiple:
        return 1
    ck = data["checkpoint"]
    sides = [(data["target_options"], data["mesh_shape"])] + ([(ck["target_options"], ck["mesh_shape"])] if ck else [])
    return math.lcm(*(multiple(o, m) for o, m in sides))


def on_mesh(data: dict, mesh: list, checkpoint: bool = False, kept: tuple | None = None) -> dict:
    """A copy with one side on ``mesh`` (its options fitted) and the batch a multiple of its unit again;
    ``kept``: ``mesh``'s dims are these dims of the side's mesh (its options projected onto them first)."""
    new = copy.deepcopy(data)
    side = new["checkpoint"] if checkpoint else new
    options = side["target_options"]
    project = spec(new["target"]).project_options
    if kept is not None and project:
        options = project(copy.deepcopy(options), tuple(kept))
    side.update(world_size=math.prod(mesh), mesh_shape=mesh,
                target_options=fit_options(new["target"], options, mesh, len(new["schedule"])))
    unit = batch_unit(new)
    new["batch"] = unit * max(1, new["batch"] // unit)
    return new


def _sub_meshes(shape: list) -> list[tuple[int, int, tuple, list]]:
    """(ranks, dims, kept dims, mesh) of every smaller mesh that keeps some of ``shape``'s dims (more than
    one), each at most its size (a kept dim of a mesh of 2+ dims at least 2): fewer ranks, or fewer dims."""
    world, out = math.prod(shape), []
    for k in range(1, len(shape) + 1):
        for kept in itertools.combinations(range(len(shape)), k):
            for mesh in itertools.product(*(range(1 if k == 1 else 2, shape[d] + 1) for d in kept)):
                ranks = math.prod(mesh)
                if ranks < world or (ranks == world and k < len(shape)):
                    out.append((ranks, k, kept, list(mesh)))
    return out


def world_edits(data: dict) -> Iterator[Edit]:
    """A smaller world, the fewest ranks first (a 1-D mesh; on a mesh of more dims and no checkpoint, any
    mesh that keeps some of its dims too), then the 1-D mesh of the same world; on either side."""
    ck = data["checkpoint"]
    for side, checkpoint, what in ((data, False, ""), (ck, True, "checkpoint ")):
        if not side:
            continue
        world, shape = side["world_size"], list(side["mesh_shape"])
        fewer = [(w, 0, f"{what}world size {world} -> {w}", [w], None) for w in range(1, world)]
        if len(shape) > 1 and not ck:
            for ranks, k, kept, mesh in _sub_meshes(shape):
                parts = ([f"world size {world} -> {ranks}"] if ranks < world else []) + [f"mesh {shape} -> {mesh}"]
                fewer.append((ranks, k, MESH_PARTS.join(parts), mesh, kept))
        for _, _, text, mesh, kept in sorted(fewer, key=lambda t: t[:2]):
            yield text, on_mesh(data, mesh, checkpoint, kept)
        if len(shape) > 1:
            yield f"{what}mesh {shape} -> [{world}]", on_mesh(data, [world], checkpoint)


def size_edits(data: dict) -> Iterator[Edit]:
    """float64 -> float32, a smaller batch and sequence (multiples of what the target needs)."""
    if data["dtype"] == "float64":
        yield "float64 -> float32", changed_copy(data, dtype="float32")
    for key, unit in (("batch", batch_unit(data)), ("seq", seq_unit(data))):
        n = data[key] // unit
        for m in smaller_sizes(n):
            yield f"{key} {data[key]} -> {m * unit}", changed_copy(data, **{key: m * unit})


def resized(case, w: int):
    """``case`` (1-D) on a 1-D mesh of ``w`` ranks, or None where it cannot be."""
    from ..case import Case

    try:
        c = Case.from_dict(on_mesh(case.to_dict(), [w], kept=(0,)))
        c.check_world()
        return c
    except Exception:
        return None
