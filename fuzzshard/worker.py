"""One rank of the persistent pool: joins the process group once, then runs
the cases the driver sends until told to stop.

A case of world size W runs on ranks 0..W-1 on a DeviceMesh built for that
case from subgroups of exactly those ranks (``init_device_mesh`` would take
the whole world). Subgroups are created once per rank set and reused: gloo
groups hold no state between collectives, and a case that leaves one in a
bad state (a hang, a crash) gets the whole pool rebuilt anyway.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import time
import traceback
from multiprocessing.connection import Client

from .case import mesh_shapes


def main() -> None:
    """Started by ``runner.Pool`` as ``python -m fuzzshard.worker`` with its
    options in the environment; stdout/stderr already go to its log file."""
    options = json.loads(os.environ["FUZZSHARD_WORKER"])
    rank, size = options["rank"], options["size"]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from . import targets
    from .case import Case
    from .kernel.run import run_case

    if options.get("setup"):
        run_setup_file(options["setup"])
    device = options["device"]
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(
        options["backend"],
        init_method=f"file://{options['store']}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=options["collective_timeout"]),
    )
    groups = {ranks: dist.new_group(list(ranks)) for ranks in rank_sets(size)}
    # Connect last: a spare generation gets fully ready before the driver needs it.
    conn = Client(tuple(options["address"]), authkey=bytes.fromhex(os.environ["FUZZSHARD_AUTHKEY"]))
    conn.send(("ready", rank, {"rank": rank, "torch": torch.__version__, "targets": targets.names()}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "exit":
            dist.destroy_process_group()
            return
        _, case_json, localize = msg
        t0 = time.perf_counter()
        try:
            case = Case.from_json(case_json)
            mesh = build_mesh(case, groups, options["mesh_device"])
            t1 = time.perf_counter()
            timings: dict = {}
            verdict = run_case(case, mesh, targets.get(case.target), device, reporter=rank == 0, timings=timings,
                               localize=localize)
        except Exception as e:  # a bug in fuzzshard or the setup file, not in the case
            verdict = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            t1, timings = time.perf_counter(), {}
        timings["mesh"] = t1 - t0
        print(f"case done in {time.perf_counter() - t0:.3f}s: {verdict and verdict.get('status')}", flush=True)
        conn.send(("verdict", verdict, timings))


def run_setup_file(path: str) -> None:
    """``--worker-setup``: run a user's file (patches, register_target) as __main__-like code."""
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__fuzzshard_setup__", "__file__": path})


def _slices(shape: tuple[int, ...]) -> list[list[list[int]]]:
    """Per mesh dim, the rank lists of the 1-D slices along it."""
    import torch

    ranks = torch.arange(math.prod(shape)).view(*shape)
    return [ranks.movedim(d, -1).reshape(-1, shape[d]).tolist() for d in range(len(shape))]


def rank_sets(size: int) -> list[tuple[int, ...]]:
    """Every rank set a case on a pool of ``size`` can need as a mesh dim. The
    groups are created by all ranks together, once, in this order: creating
    them per case with local synchronisation deadlocks once ranks have made
    different numbers of groups."""
    out = set()
    for w in range(1, size + 1):
        for shape in mesh_shapes(w):
            for dim in _slices(shape):
                out.update(tuple(s) for s in dim)
    return sorted(out, key=lambda s: (len(s), s))


def build_mesh(case, groups: dict, device_type: str):
    """A fresh DeviceMesh over ranks 0..W-1 (never init_device_mesh, which
    would take the whole pool's world)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    me = dist.get_rank()
    dim_groups = [groups[tuple(next(s for s in dim if me in s))] for dim in _slices(case.mesh_shape)]
    ranks = torch.arange(case.world_size).view(*case.mesh_shape)
    if len(dim_groups) == 1:
        return DeviceMesh.from_group(dim_groups[0], device_type, mesh=ranks)
    names = tuple(f"d{i}" for i in range(len(dim_groups)))
    return DeviceMesh.from_group(dim_groups, device_type, mesh=ranks, mesh_dim_names=names)

if __name__ == "__main__":
    main()
