# torchrun --nproc-per-node 4 min_tp_fsdp2_empty_shard_shape.py
# Root cause: fully_shard of a TP-sharded param whose TP-local shard is empty gives that rank a local
# shard of shape [0, 0] instead of [3, 0]. Embedding(6, 1) under ColwiseParallel on 2 TP ranks: TP
# rank 1 holds [6, 0]; after fully_shard on the dp dim it holds [0, 0] (ranks with the column hold
# [3, 1]), so full_tensor()'s all-gather over dp yields a dim-0 size of 0 < 6 and _maybe_unpad_tensor
# raises a bare "Expected cond to be True". A trainable param fails earlier, in the reduce-scatter
# (_chunk_cat expects non-empty tensor). Without fully_shard, full_tensor() of the TP param is exact.
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.fsdp import fully_shard
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
m = torch.nn.Embedding(6, 1)
parallelize_module(m, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
tp_local = tuple(m.weight.to_local().shape)
fully_shard(m, mesh=mesh["dp"])
print(f"rank {rank}: TP local {tp_local} -> FSDP2 local {tuple(m.weight.to_local().shape)}, "
      f"placements {m.weight.placements}", flush=True)
shapes = [None] * 4
dist.all_gather_object(shapes, tuple(m.weight.to_local().shape))
bad = any(s[1] == 0 and s[0] != 3 for s in shapes)   # an empty column shard must still have 3 rows
if rank == 0:
    print("BUG: an empty TP shard loses its row count under fully_shard" if bad else "OK", flush=True)
sys.stdout.flush(); os._exit(1 if bad else 0)   # full_tensor() here would raise on TP rank 1 and hang the others
