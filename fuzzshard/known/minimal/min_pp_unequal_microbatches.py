# torchrun --nproc-per-node 2 min_pp_unequal_microbatches.py
# ScheduleGPipe over 2 stages (ReLU | Linear) with a batch of 4 in 3 microbatches: the schedule splits it
# with torch.tensor_split into unequal microbatches (2, 1, 1) without a word, but the last stage's
# receive buffer keeps the first microbatch's shape (2 samples): the 1-sample microbatches are received
# into a 2-sample buffer, and their losses silently differ from the unsplit model's on the same
# microbatches (with params before the last stage, backward raises instead: 'Failed to run stage backward').
import sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
lin = nn.Linear(1, 1, bias=False)
full = nn.Sequential(nn.ReLU(), lin)
x, y = torch.randn(4, 1, 1), torch.randn(4, 1, 1)
mse = lambda out, target: ((out - target) ** 2).mean()
stage = PipelineStage(nn.ReLU() if rank == 0 else lin, rank, 2, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=3, loss_fn=mse, scale_grads=False)
losses = []
schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step(target=y, losses=losses)
BAD = torch.tensor(0.0)
if rank == 1:
    want = [mse(full(xm), ym) for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))]
    print("pipelined losses:", [round(v.item(), 6) for v in losses])
    print("unsplit losses:  ", [round(v.item(), 6) for v in want])
    BAD = torch.tensor(float(not all(torch.equal(a, b) for a, b in zip(losses, want))))
dist.broadcast(BAD, src=1)
if rank == 0:
    print("BUG REPRODUCED" if BAD else "ok")
dist.destroy_process_group()
sys.exit(1 if BAD else 0)   # exit 1: bug reproduced
