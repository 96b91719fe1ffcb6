# torchrun --nproc-per-node 4 min_pp_zero_bubble_fsdp_reshard_after_forward.py
# ScheduleZBVZeroBubble (the same with InterleavedZeroBubble, DualPipeV) over 4 stages of Linear(4, 4) on a
# [pp, dp] = [2, 2] mesh, each stage fully_shard()ed on the dp sub-mesh with reshard_after_forward=True
# (torchtitan's fsdp_reshard_after_forward="always"). The input backward (stage_backward_input) is handed
# self.submod.parameters() before its autograd.grad runs FSDP2's pre-backward unshard: a stage resharded after
# its forward hands over the sharded DTensor params, which are not in the forward's graph, so no param group
# is found, the weight backward (stage_backward_weight) computes nothing and that microbatch's weight grads
# are lost: the last stage gets none at all, stages 1 and 2 the grads of only some microbatches. Silent;
# reshard_after_forward=False (torchtitan's default under PP), or Interleaved1F1B, give the unsplit grads.
import copy, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
torch.manual_seed(0)
full = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
ref = copy.deepcopy(full)
x, y = torch.randn(8, 4), torch.randn(8, 4)
mse = lambda out, target: ((out - target) ** 2).mean()
mine = [pp, 3 - pp]  # V-shaped: stages r and 3 - r
stages = []
for s in mine:
    unit = nn.Sequential(full[s])
    fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=True)
    stages.append(PipelineStage(unit, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
schedule = ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=mse, scale_grads=False)
xd, yd = x.chunk(2)[dp], y.chunk(2)[dp]  # each dp rank its slice; FSDP2 averages the grads over dp
schedule.step(xd, target=yd) if 0 in mine else schedule.step(target=yd)
# the unsplit model: the mean over the dp slices of the sum of their microbatch losses
sum(sum(mse(ref(xm), ym) for xm, ym in zip(xs.chunk(2), ys.chunk(2))) for xs, ys in zip(x.chunk(2), y.chunk(2))).div(2).backward()
BAD = False
for s in mine:
    g = full[s].weight.grad
    g = None if g is None else g.full_tensor()
    ok = g is not None and torch.allclose(g, ref[s].weight.grad, atol=1e-5)
    print(f"rank {dist.get_rank()} stage {s}: pipelined grad {'None' if g is None else g.flatten()[:3].tolist()}, "
          f"unsplit grad {ref[s].weight.grad.flatten()[:3].tolist()}{'' if ok else '  <- differs'}")
    BAD |= not ok
flag = torch.tensor(float(BAD))
dist.all_reduce(flag)
if dist.get_rank() == 0:
    print("BUG REPRODUCED" if flag else "ok")
dist.destroy_process_group()
sys.exit(1 if flag else 0)   # exit 1: bug reproduced
