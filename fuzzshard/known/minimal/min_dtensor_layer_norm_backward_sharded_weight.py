# torchrun --nproc-per-node 2 min_dtensor_layer_norm_backward_sharded_weight.py
# torch <= 2.9: nn.LayerNorm whose weight is a Shard(0) DTensor: the forward strategy replicates the weight, but
# 2.9.1's _math_ops.py:_common_norm_backward_strategy takes the weight's own spec for native_layer_norm_backward
# ("no need to redistribute since they should be replicated in forward pass"), so the local backward gets this
# rank's [3] rows of the [6] weight: "Expected weight to be of same shape as normalized_shape". Frozen or not, with
# or without a bias. 2.13.0's layer_norm_bwd_single_dim_strategy asks for a Replicate weight and passes.
import sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
ln, x = nn.LayerNorm(6), torch.randn(3, 6)
ln.weight = nn.Parameter(distribute_tensor(ln.weight.detach(), mesh, [Shard(0)]))   # 6 rows over the ranks
ln.bias = nn.Parameter(distribute_tensor(ln.bias.detach(), mesh, [Replicate()]))
xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
try:
    out = ln(xd)                                       # the forward is fine
    out.sum().backward()
    bad, what = False, f"ok: weight grad {ln.weight.grad.placements}"
except RuntimeError as e:
    bad, what = True, f"backward raises RuntimeError: {str(e).splitlines()[0][:120]}"
if rank == 0:
    print(what); print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
