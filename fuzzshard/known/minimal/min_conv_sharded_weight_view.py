# torchrun --nproc-per-node 2 min_conv_sharded_weight_view.py   (gloo, CPU, torch 2.13.0)
# DTensor conv1d with a sharded weight: the output's local shards do not match its Replicate spec,
# so a later view (F.linear's fused 3-D path) fails on the local tensor; plain tensors run fine.
import torch, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
x = torch.randn(1, 1, 1)    # [B, C, L] with L == 1
w1 = torch.randn(1, 1, 3)   # conv kernel, sharded on its kernel dim (3 -> 2 | 1)
w2 = torch.randn(4, 1, 1)   # conv weight, sharded on out-channels (4 -> 2 | 2)
lw, lb = torch.randn(2, 4), torch.randn(2)

def fwd(x, w1, w2, lw, lb, tag):
    h = F.conv1d(F.conv1d(x, w1, padding=1), w2).transpose(1, 2)   # global [1, 1, 4]
    if hasattr(h, "_local_tensor"):
        l = h._local_tensor
        print(f"[{tag} r{rank}] global {tuple(h.shape)} {h.stride()} {h.placements} "
              f"contig={h.is_contiguous()} | local {tuple(l.shape)} {l.stride()} "
              f"contig={l.is_contiguous()}", flush=True)
    return F.linear(h, lw, lb)   # 3-D contiguous input + bias -> input.view([1, 4])

fwd(x, w1, w2, lw, lb, "plain")
if rank == 0: print("plain tensors: OK", flush=True)
R = [Replicate()]
d = lambda t, p: distribute_tensor(t, mesh, p)
# control: same DTensor ops with the conv weights replicated -> OK
fwd(d(x, R), d(w1, R), d(w2, R), d(lw, R), d(lb, R), "dt-repl")
if rank == 0: print("DTensor, conv weights Replicate: OK", flush=True)
try:
    fwd(d(x, R), d(w1, [Shard(2)]), d(w2, [Shard(0)]), d(lw, R), d(lb, R), "dt-shard")
    print(f"r{rank}: no error")
except RuntimeError as e:
    print(f"r{rank}: RuntimeError: {e}", flush=True)
    raise
