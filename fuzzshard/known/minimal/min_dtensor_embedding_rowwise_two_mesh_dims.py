# torchrun --nproc-per-node 4 min_dtensor_embedding_rowwise_two_mesh_dims.py
# A DTensor Embedding whose weight is row-wise sharded by both dims of a 2x2 mesh ([Shard(0), Shard(0)]:
# 8 rows, 2 per rank, rank (i, j) holding chunk j of chunk i). The output's _MaskPartial masks the token
# ids per mesh dim as if the weight were sharded by that mesh dim alone (Shard.local_shard_size_and_offset
# of the full 8 rows over that dim's 2 ranks: offset 0 or 4, 4 rows), so a rank looks rows up in its
# 2-row shard at local ids up to 3: "IndexError: index out of range in self" (or wrong rows where in range).
import sys, torch, torch.distributed as dist
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2))
torch.manual_seed(0)
weight, tokens = torch.randn(8, 3), torch.tensor([[0, 3, 5, 7]])
want = F.embedding(tokens, weight)
wd = distribute_tensor(weight, mesh, [Shard(0), Shard(0)])
print(f"rank {rank}: local rows {tuple(wd.to_local().shape)}", flush=True)
try:
    got = F.embedding(distribute_tensor(tokens, mesh, [Replicate(), Replicate()]), wd).full_tensor()
    bad, what = not torch.allclose(got, want), f"max |DTensor - plain| = {(got - want).abs().max().item():.3g}"
except Exception as e:
    bad, what = True, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
print(f"rank {rank}: {what}", flush=True)
if bad:
    print(f"rank {rank}: BUG REPRODUCED", flush=True)
# the same weight on one mesh dim ([Shard(0)] over 4 ranks) is looked up right: the nesting is what breaks it
sys.exit(1 if bad else 0)
