# torchrun --nproc-per-node 2 min_ddp_join_static_graph_unused_hang.py [--no-static-graph]
# DDP(static_graph=True, find_unused_parameters=True) under Join with uneven inputs: rank 0 runs 1 step, rank 1
# runs 2. A static-graph DDP all-reduces its locally-used-params map only in its first iteration, but once rank 0
# has joined, DDP's join hook (_DDPJoinHook.main_hook -> _match_unused_params_allreduce) shadows that all-reduce
# on every iteration it runs (it reads find_unused_parameters, not static_graph): the joined rank issues one
# all-reduce too many, the ranks' collectives shift, and the job hangs (gloo's timeout below ends it).
# With --no-static-graph (find_unused_parameters=True alone) the same loop finishes and the ranks agree.
import datetime, sys, torch, torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30)); rank = dist.get_rank()
static = "--no-static-graph" not in sys.argv
torch.manual_seed(0)
ddp = DDP(torch.nn.Linear(2, 2), find_unused_parameters=True, static_graph=static)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
steps = [1, 2][rank]  # uneven inputs
try:
    with Join([ddp]):
        for k in range(steps):
            opt.zero_grad()
            ddp(torch.randn(2, 2)).sum().backward()
            opt.step()
    w = [torch.empty(2, 2) for _ in range(2)]
    dist.all_gather(w, ddp.module.weight.detach())
    bad = not torch.equal(w[0], w[1])
    if rank == 0:
        print("the ranks' weights differ" if bad else "ok: the loop finished and the ranks agree")
except RuntimeError as e:  # the collectives out of step: gloo's timeout (or a size mismatch)
    print(f"rank {rank}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    bad = True
if rank == 0 or bad:
    print("BUG REPRODUCED" if bad else "ok", flush=True)
sys.stdout.flush()
import os; os._exit(1 if bad else 0)   # exit 1: bug reproduced (os._exit: a hung gloo pair must not block teardown)
