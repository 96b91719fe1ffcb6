# torchrun --nproc-per-node 1 min_dtensor_dropout_partial_cpu.py
# F.dropout / nn.Dropout of a Partial DTensor on a CPU mesh raises "aten.bernoulli_.float: in-place operations
# that require placement changes are not supported": on CPU at::dropout is not the fused kernel but
# _dropout_impl, which draws its noise as at::empty_like(input).bernoulli_(1 - p), and empty_like of a Partial
# DTensor is Partial too, so the in-place bernoulli_ is refused (random sampling on a partial tensor is
# undefined). The user wrote no in-place op: out-of-place ops (relu here; native_dropout on CUDA) redistribute a
# Partial input to Replicate first. A Partial activation comes e.g. out of a Linear whose weight is Shard(1).
# Seen even on a 1-rank mesh.
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
relu = F.relu(x).placements                                     # an out-of-place op: fine
same = F.dropout(x.redistribute(mesh, [Replicate()]), 0.5).placements   # the same value, Replicate: fine
try:
    F.dropout(x, 0.5)
    bad, what = False, "ok"
except RuntimeError as e:
    bad, what = True, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
if rank == 0:
    print("relu of the Partial DTensor:", relu, "; dropout of it redistributed to Replicate:", same)
    print("dropout of the Partial DTensor:", what)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
