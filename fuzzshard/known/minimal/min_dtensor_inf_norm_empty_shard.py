# torchrun --nproc-per-node 2 min_dtensor_inf_norm_empty_shard.py
# The infinity norm of a DTensor grad that leaves one rank an empty local shard (a [1, 3] weight Shard(0) over
# 2 ranks: rank 1 holds [0, 3]) raises on that rank: the norm ops run on the local shard, and torch refuses the
# max of an empty tensor ('cannot compute the infinity norm on an empty tensor because the operation does not
# have an identity'), though the global tensor is not empty and a norm's max has the identity 0. So
# torch.nn.utils.get_total_norm / clip_grad_norm_(norm_type=inf) fail on an unevenly sharded DTensor (FSDP2
# shards every param on dim 0: a param with fewer rows than ranks); the rank that raised leaves the others
# waiting in the norm's all-reduce. The 2-norm of the same grad works.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
g = torch.randn(1, 3)
dg = distribute_tensor(g, mesh, [Shard(0)])
want = g.abs().max().item()
two = torch.nn.utils.get_total_norm([dg], 2.0, foreach=True).full_tensor().item()  # the 2-norm: fine
results = {}
for foreach in (True, False):
    try:  # the local part (no collective yet: the norm is a _NormPartial DTensor until made full)
        norm, err = torch.nn.utils.get_total_norm([dg], float("inf"), foreach=foreach), ""
    except RuntimeError as e:
        norm, err = None, f"raises {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    failed = torch.tensor([float(norm is None)])
    dist.all_reduce(failed)  # every rank learns whether one raised, so none waits in the norm's all-reduce
    if failed.item():
        results[foreach] = err or "ok here, raised on another rank"
    else:
        got = norm.full_tensor().item()
        results[foreach] = "ok" if got == want else f"WRONG {got} (want {want})"
bad = any(r != "ok" for r in results.values())
print(f"rank {rank}: local shard {tuple(dg.to_local().shape)}; inf-norm foreach=True: {results[True]}; "
      f"foreach=False: {results[False]}; 2-norm {two:.4f} (want {g.norm().item():.4f})", flush=True)
if rank == 0:
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
