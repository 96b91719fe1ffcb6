# torchrun --nproc-per-node 2 min_dtensor_clip_norm_several_meshes.py
# clip_grad_norm_ (and get_total_norm) over DTensor grads that live on different device meshes raises: the
# per-tensor norms are DTensors on their own meshes, and torch.stack refuses operands of different meshes
# ('All operands in aten.stack.default must have the same mesh'). FSDP2 over a TP plan puts the params TP
# parallelizes on the 2-D [dp, tp] mesh and the rest on the 1-D dp mesh, so the training loop's
# clip_grad_norm_(model.parameters()) fails there (pytorch/pytorch#180346, open; torchtitan groups the grads
# by mesh itself). Here: one param on a 1-D mesh of the 2 ranks, one on a 2-D (1, 2) mesh of the same ranks.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
flat = init_device_mesh("cpu", (world,))
square = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
a, b = torch.randn(4, 3), torch.randn(4, 3)
pa = torch.nn.Parameter(distribute_tensor(a, flat, [Shard(0)]))
pb = torch.nn.Parameter(distribute_tensor(b, square, [Replicate(), Shard(0)]))
pa.grad, pb.grad = distribute_tensor(a, flat, [Shard(0)]), distribute_tensor(b, square, [Replicate(), Shard(0)])
want = torch.cat([a.flatten(), b.flatten()]).norm().item()
try:
    norm = torch.nn.utils.clip_grad_norm_([pa, pb], max_norm=1.0)
    got = norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
    bad, said = abs(got - want) > 1e-5 * want, f"norm {got:.6f} (want {want:.6f})"
except RuntimeError as e:
    bad, said = True, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
print(f"rank {rank}: clip_grad_norm_ over a 1-D and a 2-D mesh's params: {said}", flush=True)
if rank == 0:
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
