"""One rank of the persistent pool: joins the process group once, then runs
the cases the driver sends until told to stop.

A case of world size W runs on ranks o..o+W-1 (o: the offset the driver
placed it at, 0 unless cases run side by side) on DeviceMeshes built for that
case from subgroups of exactly those ranks (kernel/mesh.py). Subgroups are
created once per rank set and reused: gloo groups hold no state between
collectives, and a case that leaves one in a bad state (a hang, a crash)
gets the whole pool rebuilt anyway.
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Client


def main() -> None:
    """Forked by the zygote (or started as ``python -m fuzzshard.pool.worker``) for
    ``runner.Pool``, with its options in the environment; stdout/stderr
    already go to its log file."""
    options = json.loads(os.environ["FUZZSHARD_WORKER"])
    rank, size = options["rank"], options["size"]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Ctrl-C, and SIGTERM from `timeout` or a batch scheduler, reach the whole process group: the driver
    # decides what a stop means (it ends after the case running, then closes the pool), not each rank; a
    # rank killed by it would be a crash of that case, never the user's stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    _name(f"fuzzshard-r{rank}")  # what ps and top show
    faulthandler.register(signal.SIGUSR1, all_threads=False)  # the driver asks a stuck rank where it waits
    faulthandler.enable(all_threads=True)  # a rank killed by SIGSEGV or SIGABRT says where it died (an abort
    # in a gloo thread has no Python frames of its own: the main thread says where the case was)
    from .. import targets
    from ..case import Case
    from ..kernel.mesh import Meshes
    from ..kernel.run import report_phases, run_bare, run_case
    from ..verdict import Verdict, failure, invalid
    from .message import CaseDone, Exit, Ready
    from ..kernel.state_io import close_stagers

    if os.environ.get("FUZZSHARD_PHASE"):  # where this rank is (kernel/run.py), for the driver to read if it hangs
        report_phases(os.environ["FUZZSHARD_PHASE"])

    for path in options.get("setup") or []:
        run_setup_file(path)
    device = options["device"]
    if device == "cuda":
        torch.cuda.set_device((options.get("device_offset", 0) + rank) % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    timeout = datetime.timedelta(seconds=options["collective_timeout"])
    store = options["store"]
    if isinstance(store, dict):  # a cell spanning processes meets in torchrun's store (span.py)
        from .store import open_store

        where = {"store": open_store(store, options["collective_timeout"])}
    else:  # a cell of this machine: a file store in the driver's temp folder
        where = {"init_method": f"file://{store}"}
    if options.get("simulate"):  # --simulate: this process runs whole cases alone, every rank (kernel/simulated.py)
        from ..kernel.simulated import SimulatedWorld

        meshes = SimulatedWorld()
    else:
        dist.init_process_group(options["backend"], rank=rank, world_size=size, timeout=timeout, **where)
        meshes = Meshes(size, options["mesh_device"], placed=options.get("placed", False))
    # Connect last: a spare generation gets fully ready before the driver needs it.
    conn = Client(tuple(options["address"]), authkey=bytes.fromhex(os.environ["FUZZSHARD_AUTHKEY"]))
    info = {"rank": rank, "torch": torch.__version__, "targets": targets.names()}
    if options["device"] == "cuda":
        info.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    conn.send(Ready(rank, info))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, Exit):
            close_stagers()  # the DefaultStagers async saves keep: their threads end with them
            dist.destroy_process_group()
            return
        order = msg  # a RunCase (message.py)
        offset = order.offset
        t0 = time.perf_counter()
        try:
            case = Case.from_json(order.case_json)
            timings: dict = {}
            refusal = case.refusal()
            if refusal:  # a case the rule refuses is no test, whoever sent it: every rank says so, none runs it
                verdict = invalid(f"refused: {refusal}")
            else:
                with meshes.placed(offset, case.ranks):
                    if order.bare:  # bench's floor: the sharded training alone
                        verdict = run_bare(case, meshes, targets.get(case.target), device, reporter=rank == offset,
                                           timings=timings)
                    else:
                        verdict = run_case(case, meshes, targets.get(case.target), device, reporter=rank == offset,
                                           timings=timings, localize=order.localize, ckpt_dir=order.ckpt_dir)
        except Exception as e:  # a bug in fuzzshard or the setup file, not in the case
            verdict = failure(f"{type(e).__name__}: {e}", traceback.format_exc())
            timings = {}
        if "torch._dynamo" in sys.modules:  # a case compiled something (--compile, a plugin): its guards and
            torch._dynamo.reset()  # graphs would stay with the process and reach the next case (10 us)
        _forget_sharding_decisions()  # torch <= 2.10 at least: DTensor's cache keyed without a shape argument
        print(f"case done in {time.perf_counter() - t0:.3f}s: {verdict and verdict.get('status')}", flush=True)
        conn.send(CaseDone(Verdict.from_dict(verdict) if verdict is not None else None, timings))


_STALE_KEYS: bool | None = None  # whether this torch's sharding cache needs emptying (decided once)


def _forget_sharding_decisions() -> None:
    """DTensor's sharding propagation cache, emptied between cases where its key leaves out an argument that
    decides an output's shape. embedding_dense_backward's strategy was registered without
    ``RuntimeSchemaInfo(static_argnum=2)`` (torch 2.9.1 and 2.10.0; fixed by pytorch/pytorch#174727, in
    2.13.0): its num_weights is not in the key, so a case whose embedding has another vocabulary size than an
    earlier case's, with the same grad and index specs, gets that case's weight-grad shape ("EmbeddingBackward0
    returned an invalid gradient ... got [1, 1] but expected shape compatible with [4, 1]"; a grad its weight
    can be summed to passes, summed down). Two independent runs in one process meet it; a fresh worker does
    not (fuzzshard/known/minimal/min_dtensor_embedding_backward_cache_num_weights.py). The releases that need
    it are told by the registration itself; there, both caches: the Python one (a thread-local lru_cache with
    no cache_clear of its own before 2.10) and the C++ fast path's (2.10). The reset takes 0.1 ms; the next
    DTensor case then propagates its ops anew: +40 ms (2.9.1) to +80 ms (2.10.0) for an embedding and two
    linears trained two steps, on those releases only."""
    global _STALE_KEYS
    if "torch.distributed.tensor" not in sys.modules or _STALE_KEYS is False:
        return
    import torch
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    if _STALE_KEYS is None:  # (a later torch that moved these has the fix: never a worker's error between cases)
        op = torch.ops.aten.embedding_dense_backward.default
        info = (getattr(prop, "op_to_schema_info", {}).get(op)
                or getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op))
        _STALE_KEYS = hasattr(prop, "op_to_schema_info") and (info is None or info.static_argnum > 2)
        if not _STALE_KEYS:
            return
    prop.propagate_op_sharding.cache.cache_clear()  # LocalLRUCache: this (the main) thread's lru_cache
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def _die_with_parent() -> None:
    """A driver killed with SIGKILL takes its ranks with it (Linux): none is
    left blocked in a collective, holding a GPU."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _name(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_setup_file(path: str) -> None:
    """``--worker-setup``: run a user's file (patches, register_target) as __main__-like code."""
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__fuzzshard_setup__", "__file__": path})


def _exit_now(code: int) -> None:
    """Leave without interpreter finalization. A DeviceMesh keeps the default
    gloo group alive past destroy_process_group, and a gloo run-loop thread
    still dropping a finished work's tensors then needs the GIL while Python
    finalizes: "terminate called without an active exception", SIGABRT, in
    about one exit in four (fuzzshard/known/minimal/min_gloo_mesh_exit_abort.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    _exit_now(0)
