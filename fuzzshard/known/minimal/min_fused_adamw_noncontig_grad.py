# torchrun --nproc-per-node 2 min_fused_adamw_noncontig_grad.py
# Root cause: CPU fused optimizers (torch._fused_adam(w)_, also fused SGD/Adagrad) ignore the grad's
# strides and read it as if contiguous. DTensor triggers it: redistributing a Partial (or Shard(0))
# grad to an *uneven* Shard(1) param placement leaves the last rank's local grad as a
# non-contiguous view of the padded buffer (e.g. shape (9,3), stride (4,1)).
import sys, torch, torch.distributed as dist
BAD = False
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
dist.init_process_group("gloo"); rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
torch.manual_seed(0)
w, g = torch.randn(9, 7), torch.randn(9, 7)     # 7 columns over 2 ranks: 4 + 3 (uneven)

def step(fused, make_contig=False):
    p = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(1)]))
    gd = DTensor.from_local(g / W, mesh, [Partial()])   # what autograd gives a tied weight
    if make_contig:  # workaround: reduce-scatter ourselves and make the local shard contiguous
        s = gd.redistribute(mesh, [Shard(1)])
        gd = DTensor.from_local(s.to_local().contiguous(), mesh, [Shard(1)], shape=s.shape, stride=s.stride())
    p.grad = gd
    torch.optim.AdamW([p], lr=0.1, fused=fused, foreach=not fused).step()
    return p.full_tensor()

ref = torch.nn.Parameter(w.clone()); ref.grad = g.clone()
torch.optim.AdamW([ref], lr=0.1).step()
loc = DTensor.from_local(g / W, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
res = {k: step(*a) for k, a in {"fused": (True,), "foreach": (False,), "fused+contig": (True, True)}.items()}
print(f"rank {rank}: reduce-scattered local grad shape {tuple(loc.shape)} stride {loc.stride()} contiguous={loc.is_contiguous()}")

# the same kernel bug without DTensor: one process, plain tensors
p1 = torch.nn.Parameter(w.clone()); p1.grad = torch.randn(7, 9).t()        # non-contiguous grad
p2 = torch.nn.Parameter(w.clone()); p2.grad = p1.grad.contiguous()
torch.optim.AdamW([p1], lr=0.1, fused=True).step(); torch.optim.AdamW([p2], lr=0.1, fused=True).step()
if rank == 0:
    for k, v in res.items():
        print(f"DTensor AdamW {k:13s} max |err| vs plain = {(v - ref.detach()).abs().max().item():.2e}")
    print(f"plain fused AdamW, grad non-contiguous vs contiguous: max |diff| = {(p1 - p2).abs().max().item():.2e}")
    BAD = True if (res["fused"] - ref.detach()).abs().max() > 1e-4 else False
    print("BUG REPRODUCED" if BAD else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if BAD else 0)   # exit 1: bug reproduced
