# python min_ddp_powersgd_gloo_callback_race.py [sync]
# powerSGD_hook over two buckets or more on gloo: the ranks' collectives pair in different orders (a race).
# powerSGD_hook all-reduces the bucket's uncompressed part asynchronously and launches the P and Q all-reduces
# from that future's callbacks (unpack_uncompressed_tensors_and_allreduce_ps, compute_qs), which gloo runs on
# its own worker thread, while the autograd thread goes on to launch the next bucket's hook and its all-reduce.
# Gloo pairs collectives by their order on each rank, so the order in which the two threads launch them can
# differ between the ranks: 'Received data size doesn't match expected size' (SIGABRT) or a hang, at the first
# PowerSGD iteration. One bucket (the default 25 MiB cap on a small model) passes; so does waiting each bucket's
# future in the hook (`sync`). A race: each trial is a fresh pair of processes; the first bad trial ends it.
import os, sys, datetime
import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

TRIALS, HANG_S = 6, 45


def run(rank, sync, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=HANG_S))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    ddp = DDP(model, bucket_cap_mb=4e-5, find_unused_parameters=True)  # a few params a bucket, never rebuilt
    state = ps.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.0)

    def hook(state, bucket):
        if not sync:
            return ps.powerSGD_hook(state, bucket)
        fut = torch.futures.Future()  # each bucket's reduction run to its end before the next bucket's starts
        fut.set_result(ps.powerSGD_hook(state, bucket).wait())
        return fut

    ddp.register_comm_hook(state, hook)
    for k in range(4):
        ddp(torch.randn(4, 5, dtype=torch.double)).sum().backward()
    dist.destroy_process_group()


def trial(sync, port):
    """None: both ranks finished; else what went wrong."""
    ctx = mp.start_processes(run, args=(sync, port), nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(HANG_S + 15)
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    codes = [p.exitcode for p in ctx.processes]
    if alive:
        return f"hang: ranks still in the backward after {HANG_S + 15} s"
    return None if codes == [0, 0] else f"rank exit codes {codes} (-6: SIGABRT, gloo's size mismatch)"


if __name__ == "__main__":
    sync = len(sys.argv) > 1 and sys.argv[1] == "sync"
    for t in range(TRIALS):
        bad = trial(sync, 29541 + t)
        print(f"trial {t}: {bad or 'ok'}", flush=True)
        if bad:
            print(f"BUG REPRODUCED: powerSGD_hook on gloo over several buckets: {bad}")
            sys.exit(1)
    print("ok")
