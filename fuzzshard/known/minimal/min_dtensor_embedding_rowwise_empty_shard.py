# torchrun --nproc-per-node 4 min_dtensor_embedding_rowwise_empty_shard.py
# A row-wise (Shard(0)) DTensor Embedding with fewer rows than a full chunk per rank: 6 rows over 4 ranks
# chunk as 2, 2, 2, 0. The rank whose shard is empty raises in index_select ("self indexing axis dim should
# be positive") while the other ranks wait in the collective that follows; here they time out after 20 s.
import datetime, sys, torch, torch.distributed as dist
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20)); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
weight, tokens = torch.randn(6, 5), torch.tensor([[0, 3, 5]])
want = F.embedding(tokens, weight)
wd = distribute_tensor(weight, mesh, [Shard(0)])
print(f"rank {rank}: local rows {tuple(wd.to_local().shape)}", flush=True)
try:
    got = F.embedding(distribute_tensor(tokens, mesh, [Replicate()]), wd).full_tensor()
    bad, what = not torch.allclose(got, want), f"max |DTensor - plain| = {(got - want).abs().max().item():.3g}"
except Exception as e:  # the empty rank raises; the others time out waiting for it
    bad, what = True, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
print(f"rank {rank}: {what}", flush=True)
if bad:
    print(f"rank {rank}: BUG REPRODUCED", flush=True)
sys.exit(1 if bad else 0)   # exit 1: bug reproduced (no clean teardown: the group is broken)
