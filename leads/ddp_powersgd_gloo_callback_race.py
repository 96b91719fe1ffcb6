"""powerSGD_hook over two buckets or more on gloo: the ranks' collectives pair in different orders.

python leads/ddp_powersgd_gloo_callback_race.py          # torch 2.13.0 CPU: a gloo abort (size mismatch) or a hang
python leads/ddp_powersgd_gloo_callback_race.py sync     # each bucket's future waited in the hook: passes

powerSGD_hook all-reduces the bucket's uncompressed part asynchronously and launches the P and Q all-reduces
from that future's callbacks (unpack_uncompressed_tensors_and_allreduce_ps, compute_qs), which gloo runs on its
own worker thread, while the autograd thread goes on to launch the next bucket's hook and its all-reduce. Gloo
pairs collectives by their order on each rank, so the order in which the two threads launch them differs
between the ranks: 'Received data size doesn't match expected size' (SIGABRT) or a hang, at the first PowerSGD
iteration. One bucket (the default 25 MiB cap on a small model) passes; so does waiting each bucket's future."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP


def run(rank, sync):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    ddp = DDP(model, bucket_cap_mb=4e-5, find_unused_parameters=True)  # a few params a bucket, never rebuilt
    state = ps.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.0)

    def hook(state, bucket):
        if not sync:
            return ps.powerSGD_hook(state, bucket)
        fut = torch.futures.Future()
        fut.set_result(ps.powerSGD_hook(state, bucket).wait())
        return fut

    ddp.register_comm_hook(state, hook)
    for k in range(4):
        ddp(torch.randn(4, 5, dtype=torch.double)).sum().backward()
        print(f"rank {rank} step {k} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(len(sys.argv) > 1 and sys.argv[1] == "sync",), nprocs=2)
