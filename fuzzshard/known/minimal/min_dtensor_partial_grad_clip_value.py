# torchrun --nproc-per-node 2 min_dtensor_partial_grad_clip_value.py
# DTensor autograd hands back a param's .grad in another placement than the param's: a Replicate Linear
# weight fed a batch sharded on dim 0 gets a Partial(sum) grad (each rank's sum over its rows, not yet
# reduced). An in-place op on that grad itself then raises, as DTensor refuses in-place ops that would
# change the placement: torch.nn.utils.clip_grad_value_ (clamp_ / _foreach_clamp_min_, a clamp does not
# commute with the pending sum), as zero_grad(set_to_none=False) (zero_) does. The optimizer's step on the
# same grad works (its in-place writes go to the param and its state, in the param's placement), and so
# does clip_grad_norm_ (norms reduce the Partial; the in-place mul by a scalar keeps it Partial).
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
lin = torch.nn.Linear(3, 2, bias=False)
lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate()]))
x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])  # the batch, sharded over the ranks
lin(x).pow(2).mean().backward()
param_p, grad_p = lin.weight.placements, lin.weight.grad.placements
bad, what = False, {}
for foreach in (False, True):
    try:
        torch.nn.utils.clip_grad_value_([lin.weight], 0.01, foreach=foreach)
        what[foreach] = "ok"
    except RuntimeError as e:
        bad, what[foreach] = True, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
try:  # for contrast: the optimizer step on the same grad
    torch.optim.Adam([lin.weight], lr=0.1, foreach=True).step()
    what["Adam(foreach=True).step()"] = "ok"
except RuntimeError as e:
    bad, what["Adam(foreach=True).step()"] = True, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
if rank == 0:
    print(f"param placements {param_p}, its grad's placements {grad_p}")
    for call, w in what.items():
        print(f"clip_grad_value_(foreach={call}): {w}" if isinstance(call, bool) else f"{call}: {w}")
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
