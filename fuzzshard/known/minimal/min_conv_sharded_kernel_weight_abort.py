# torchrun --nproc-per-node 2 min_conv_sharded_kernel_weight_abort.py   (gloo, CPU, torch 2.13.0)
# DTensor conv1d with its weight sharded on the kernel dim (Shard(2): 3 -> 2 | 1) after a row-sharded embedding:
# the convolution handler (_tp_conv.py) runs the local conv on each rank's un-redistributed kernel slice and labels
# the result with the propagated spec, Shard(0) of [2, 1, 7]: the local outputs are [2, 2, 7] and [2, 3, 7], not
# [1, 1, 7]. full_tensor() then all-gathers mismatched sizes: rank 1 raises in _maybe_unpad_tensor ('narrow
# unexpectedly changed concrete size'), gloo aborts rank 0 ('Received data size doesn't match expected size': SIGABRT).
# Exit 1 (or a SIGABRT): reproduced. Replicated weights give the plain result.
import os, torch, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Replicate, Shard

dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
emb, w, tok = torch.randn(2, 5), torch.randn(7, 5, 3), torch.tensor([[0], [1]])
want = F.conv1d(F.embedding(tok, emb).transpose(1, 2), w, padding=1).transpose(1, 2)
h = F.embedding(distribute_tensor(tok, mesh, [Replicate()]), distribute_tensor(emb, mesh, [Shard(0)]))
out = F.conv1d(h.transpose(1, 2), distribute_tensor(w, mesh, [Shard(2)]), padding=1).transpose(1, 2)
print(f"rank {rank}: {out.placements} global {tuple(out.shape)}, local {tuple(out.to_local().shape)}", flush=True)
try:
    bad = not torch.allclose(out.full_tensor(), want, atol=1e-5)
except RuntimeError as e:
    print(f"rank {rank}: RuntimeError: {e}", flush=True)
    bad = True
print(f"rank {rank}: " + ("BUG REPRODUCED" if bad else "ok"), flush=True)
os._exit(1 if bad else 0)
