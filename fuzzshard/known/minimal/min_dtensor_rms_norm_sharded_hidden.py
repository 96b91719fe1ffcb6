# torchrun --nproc-per-node 1 min_dtensor_rms_norm_sharded_hidden.py
# F.rms_norm / nn.RMSNorm on a DTensor sharded on the normalized (hidden) dim raises: its decomposition
# takes the mean of squares (a Partial(avg) DTensor) and adds eps to it in place, which DTensor refuses.
# layer_norm on the same input works (DTensor has a strategy for it). Seen even on a 1-rank mesh.
import sys, torch, torch.distributed as dist
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
x, w = torch.randn(2, 3, 4), torch.randn(4)
want = F.rms_norm(x, (4,), w, eps=1e-6)
xd = distribute_tensor(x, mesh, [Shard(2)])            # e.g. a row-wise Embedding's output, hidden dim sharded
wd = distribute_tensor(w, mesh, [Shard(0)])
ln = F.layer_norm(xd, (4,), wd).full_tensor()          # the sibling norm is fine
try:
    got = F.rms_norm(xd, (4,), wd, eps=1e-6).full_tensor()
    bad, what = not torch.allclose(got, want, atol=1e-5), f"max |DTensor - plain| = {(got - want).abs().max().item():.3g}"
except RuntimeError as e:
    bad, what = True, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
if rank == 0:
    print("layer_norm on the same DTensor: ok, max |diff| =",
          f"{(ln - F.layer_norm(x, (4,), w)).abs().max().item():.3g}")
    print("rms_norm:", what)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
