# torchrun --nproc-per-node 2 min_zero_bucket_view_frozen_param.py
# ZeroRedundancyOptimizer(parameters_as_bucket_view=True): a param frozen mid-run (requires_grad_(False)) that
# still holds a grad (zero_grad(set_to_none=False) leaves a zero tensor) is stepped by its owner rank (torch.optim
# steps any param whose grad is not None: Adam's momentum moves it), but the rebuilt buckets hold only trainable
# params, so the update is never broadcast and the replicas of that param diverge silently.
import sys, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
BUCKET_VIEW = True   # False: every param is broadcast one by one -> replicas agree
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
model.load_state_dict(ref.state_dict())
opt_ref = torch.optim.Adam(ref.parameters(), lr=0.1)   # plain, unsharded
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1,
                              parameters_as_bucket_view=BUCKET_VIEW)
x = torch.randn(4, 2)   # same data on every rank: replicas must stay identical
for step in range(3):
    for m, o in ((ref, opt_ref), (model, opt)):
        o.zero_grad(set_to_none=False)
        if step == 2:
            m[0].weight.requires_grad_(False)   # freeze mid-run; its grad stays a zero tensor
        m(x).sum().backward()
        o.step()
w = model[0].weight.detach().clone()
reps = [torch.empty_like(w) for _ in range(world)]
dist.all_gather(reps, w)
spread = max((r - reps[0]).abs().max().item() for r in reps)
err = [(r - ref[0].weight).abs().max().item() for r in reps]
bad = spread > 1e-6
if rank == 0:
    print("frozen param owned by rank", opt._param_to_rank[model[0].weight])
    print("frozen param, plain Adam    :", ref[0].weight.detach().flatten().tolist())
    for r, rep in enumerate(reps):
        print(f"frozen param, ZeRO rank {r}  :", rep.flatten().tolist(), " max|diff vs plain| %.3g" % err[r])
    print("replicas differ by %.3g" % spread)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
