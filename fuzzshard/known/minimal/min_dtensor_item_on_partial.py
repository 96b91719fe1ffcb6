# torchrun --nproc-per-node 2 min_dtensor_item_on_partial.py
# .item() on a Partial DTensor (e.g. the norm of a Shard(0) vector) returns this rank's *local* value,
# not the reduced one. Adafactor calls param.norm(2).item() and update.norm(2).item(), so on a 1-D
# Shard(0) param (every FSDP2 bias / norm weight) it silently takes a different step than plain torch.
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
if os.environ.get("FIX") == "1":   # reduce before reading the scalar (what replica_only_strategy asks for)
    DTensor._op_dispatcher._custom_op_handlers[torch.ops.aten._local_scalar_dense.default] = \
        lambda op, args, kwargs: args[0].full_tensor().item()

v = torch.tensor([3.0, 4.0])
n = distribute_tensor(v, mesh, [Shard(0)]).norm(2)
got, want = n.item(), v.norm(2).item()
got_all = [None, None]; dist.all_gather_object(got_all, got)

p_ref = torch.nn.Parameter(torch.ones(2)); p_ref.grad = torch.tensor([1.0, -2.0])   # e.g. a LayerNorm weight
p_dt = torch.nn.Parameter(distribute_tensor(p_ref.detach(), mesh, [Shard(0)]))
p_dt.grad = distribute_tensor(p_ref.grad, mesh, [Shard(0)])
for p in (p_ref, p_dt):
    torch.optim.Adafactor([p], lr=1e-3, foreach=False).step()
full = p_dt.full_tensor()
err = (full - p_ref).abs().max().item()
bad = any(g != want for g in got_all) or err > 1e-6   # same on every rank
if rank == 0:
    print("norm placements:", n.placements)
    print(f"[3,4] Shard(0) .norm(2).item(): expected {want}, got per rank {got_all}")
    print("Adafactor step, plain  :", p_ref.detach().tolist())
    print("Adafactor step, DTensor:", full.tolist(), f"max |diff| = {err:.3g}")
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
