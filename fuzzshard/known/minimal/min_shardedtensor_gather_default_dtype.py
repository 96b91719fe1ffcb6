# torchrun --nproc-per-node 1 min_shardedtensor_gather_default_dtype.py
# ShardedTensor.gather(dst, out) with the default dtype=None stages the shards in torch.empty(..., dtype=None)
# buffers, i.e. the default dtype (float32): a float64 ShardedTensor gathered into a float64 `out` comes back
# silently rounded to float32. Upstream calls this by design (PR #110561: pass dtype=); the script shows it.
import sys, warnings, torch, torch.distributed as dist
from torch.distributed._shard.api import _shard_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
full = torch.tensor([0.1, 1 / 3, 2 / 3, 1e-9 + 1.0], dtype=torch.float64)
spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
st = _shard_tensor(full.clone(), spec)                     # float64 ShardedTensor
out = torch.zeros(4, dtype=torch.float64) if rank == 0 else None
st.gather(dst=0, out=out)                                  # dtype=None (default)
out2 = torch.zeros(4, dtype=torch.float64) if rank == 0 else None
st.gather(dst=0, out=out2, dtype=torch.float64)            # workaround: pass dtype explicitly
bad = torch.tensor(0)
if rank == 0:
    d, d2 = (out - full).abs().max().item(), (out2 - full).abs().max().item()
    print("sharded tensor dtype   :", st.local_shards()[0].tensor.dtype, " torch default dtype:", torch.get_default_dtype())
    print("expected (the shards)  :", full.tolist())
    print("gather(out)            :", out.tolist(), " max abs diff %.3g" % d)
    print("gather(out, dtype=f64) :", out2.tolist(), " max abs diff %.3g" % d2)
    bad = torch.tensor(int(d > 0))
    print("BUG REPRODUCED (float64 shards rounded to float32 by gather with dtype=None)" if bad else "ok")
dist.broadcast(bad, 0)
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad.item() else 0)   # exit 1: the behaviour shows
