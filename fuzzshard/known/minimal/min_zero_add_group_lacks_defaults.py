# torchrun --nproc-per-node 1 min_zero_add_group_lacks_defaults.py
# ZeroRedundancyOptimizer.add_param_group: the new group in zero.param_groups lacks the inner optimizer's
# own defaults (capturable, differentiable, foreach, maximize, ...): ZeRO's defaults are only the kwargs it
# was given, and the group gets the rest only when a step syncs the local optimizer's groups back
# (_sync_param_groups). A step GradScaler skips (an inf in the grads) never calls optimizer.step, so after
# it the group still lacks them, where torch.optim.Adam's added group holds them from add_param_group on.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.optim import ZeroRedundancyOptimizer
dist.init_process_group("gloo"); rank = dist.get_rank()
a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
zero = ZeroRedundancyOptimizer([a], optimizer_class=torch.optim.Adam, lr=0.01)
zero.add_param_group({"params": [b]})
plain = torch.optim.Adam([a], lr=0.01)
plain.add_param_group({"params": [b]})
scaler = torch.amp.GradScaler("cpu")
for opt in (zero, plain):
    scaler.scale((a * b).sum() * float("inf")).backward()  # an overflow: the step is skipped
    scaler.step(opt)
    scaler.update()
    a.grad = b.grad = None
lacks = sorted(set(plain.param_groups[1]) - set(zero.param_groups[1]))
bad = bool(lacks)
if rank == 0:
    print("ZeRO's added group after a skipped step lacks:", lacks)
    print("BUG REPRODUCED" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
