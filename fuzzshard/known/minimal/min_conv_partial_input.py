# torchrun --nproc-per-node 2 min_conv_partial_input.py
# DTensor conv1d on a Partial(sum) input (e.g. the output of a Linear whose weight is Shard(1))
# returns a DTensor labelled Replicate() holding each rank's *unreduced* local partial result.
import sys, torch, torch.distributed as dist
BAD = False
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
x = torch.randn(3, 4, 5)                 # [B, C_in, L]
w_lin = torch.randn(4, 4)                # Linear over C (applied on [B, L, C])
w_conv = torch.randn(6, 4, 1)            # Conv1d(4, 6, kernel=1, bias=False)

def f(x, w_lin, w_conv):
    h = F.linear(x.transpose(1, 2), w_lin).transpose(1, 2)
    return F.conv1d(h, w_conv)

ref = f(x, w_lin, w_conv)
xd = distribute_tensor(x, mesh, [Replicate()])
wl = distribute_tensor(w_lin, mesh, [Shard(1)])   # -> linear output is Partial(sum)
wc = distribute_tensor(w_conv, mesh, [Replicate()])
h = F.linear(xd.transpose(1, 2), wl).transpose(1, 2)
out = F.conv1d(h, wc)
full = out.full_tensor()
good = F.conv1d(h.redistribute(mesh, [Replicate()]), wc).full_tensor()   # workaround
if rank == 0:
    print("conv input placements :", h.placements)          # (Partial(sum),)
    print("conv output placements:", out.placements)        # (Replicate(),)  <- pending sum dropped
    print("max |DTensor - plain| :", (full - ref).abs().max().item())
    print("with explicit redistribute to Replicate first:", (good - ref).abs().max().item())
    bad = not torch.allclose(full, ref, atol=1e-5)
    BAD = True if bad else False
    print("BUG REPRODUCED" if BAD else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if BAD else 0)   # exit 1: bug reproduced
