# torchrun --nproc-per-node 2 min_pp_zero_bubble_frozen_first_stage.py
# ScheduleInterleavedZeroBubble over 4 stages of Linear(1, 1), two a rank, the first stage frozen (as a
# frozen embedding in fine-tuning): stage 1's input does not require grad, so stage_backward_input finds
# no path from the inputs to the weights, saves no intermediates for the weight backward, and stage 1's
# weight is left without a grad: silently, the optimizer then skips it. GPipe and 1F1B give it the grad.
import sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
mods = [nn.Linear(1, 1, bias=False) for _ in range(4)]
mods[0].requires_grad_(False)  # the frozen first stage
x, y = torch.randn(2, 1), torch.randn(2, 1)
mse = lambda out, target: ((out - target) ** 2).mean()
mine = [rank, rank + world]
stages = [PipelineStage(mods[s], s, 2 * world, torch.device("cpu")) for s in mine]
schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=2, loss_fn=mse, scale_grads=False)
schedule.step(x, target=y) if rank == 0 else schedule.step(target=y)
got = [None, None]
dist.all_gather_object(got, {s: mods[s].weight.grad for s in mine})
if rank == 0:
    pipelined = {s: g for part in got for s, g in part.items()}
    for m in mods:
        m.weight.grad = None
    full = nn.Sequential(*mods)
    sum(mse(full(xm), ym) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))).backward()
    BAD = False
    for s in (1, 2, 3):
        print(f"stage {s}: pipelined grad {pipelined[s]}, unsplit grad {mods[s].weight.grad}")
        BAD |= pipelined[s] is None
    print("BUG REPRODUCED" if BAD else "ok")
else:
    BAD = False
flag = torch.tensor(float(BAD))
dist.broadcast(flag, src=0)
dist.destroy_process_group()
sys.exit(1 if flag else 0)   # exit 1: bug reproduced
