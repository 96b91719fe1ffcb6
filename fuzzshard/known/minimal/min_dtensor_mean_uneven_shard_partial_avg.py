# torchrun --nproc-per-node 2 min_dtensor_mean_uneven_shard_partial_avg.py
# DTensor's mean over a dim sharded unevenly (9 = 5 | 4 over 2 ranks): torch 2.9's common_reduction_strategy maps
# aten.mean to Partial("avg") of the local means without checking that the dim shards evenly, so the value is the
# average of 5 elements' mean and 4 elements' mean, not the mean of 9. Silent: a wrong loss, its grad still right
# (the backward divides by the global numel). 2.13.0 checks is_tensor_evenly_shardable_on_dim and replicates first.
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
x = torch.arange(9, dtype=torch.float32) ** 2  # the same on every rank
got = distribute_tensor(x, mesh, [Shard(0)]).mean().full_tensor()
want = x.mean()
ok = torch.allclose(got, want)
if dist.get_rank() == 0:
    print(f"mean of a 9-element tensor sharded over {dist.get_world_size()} ranks: {got.item():g}, unsharded "
          f"{want.item():g}: {'ok' if ok else 'BUG REPRODUCED'}")
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
