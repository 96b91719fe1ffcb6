# torchrun --nproc-per-node 2 min_dtensor_amp_found_inf_first_grad_placements.py
# torch.amp.GradScaler over DTensor params of mixed placements: an inf in one rank's shard of a Shard(0) grad
# is found on that rank only when the optimizer's first grad is Replicate, so the ranks disagree on skipping
# the step (silent divergence, or a hang/crash where the step runs collectives). DTensor's handler for
# aten._amp_foreach_non_finite_check_and_unscale_ (torch/distributed/tensor/_dispatch.py,
# found_inf_reduce_handler) reduces found_inf with Partial("max") over the mesh dims where args[0][0] (the
# FIRST grad of the foreach list) is not Replicate; the placements of the other grads in the list are never
# read. With the Shard(0) param first, the same inf is found on every rank.
import sys, torch, torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
seen = {}
for order in ("shard first", "replicate first"):
    rep = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    shard = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    rep.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    g = torch.ones(4, 2)
    g[3, 1] = float("inf")  # rows 2-3 are rank 1's shard: only rank 1 holds the inf
    shard.grad = distribute_tensor(g, mesh, [Shard(0)])
    params = [shard, rep] if order == "shard first" else [rep, shard]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))  # (the scale made, as scaler.scale(loss).backward() makes it)
    scaler.unscale_(opt)
    found = sum(float(v.sum()) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    every = [None, None]
    dist.all_gather_object(every, found)
    seen[order] = every
bad = seen["shard first"] == [1.0, 1.0] and seen["replicate first"] != [1.0, 1.0]
if rank == 0:
    for order, every in seen.items():
        print(f"{order}: found_inf on ranks 0, 1 = {every}")
    print("BUG REPRODUCED: the ranks disagree on skipping the step" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
