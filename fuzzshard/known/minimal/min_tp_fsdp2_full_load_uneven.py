# torchrun --nproc-per-node 4 min_tp_fsdp2_full_load_uneven.py
# Root cause: DSD's full-state-dict load (set_model_state_dict with full_state_dict=True) re-shards
# each full tensor with distribute_tensor(full, mesh, param.placements). Under TP + FSDP2 a colwise
# param is (_StridedShard(0, sf=2), Shard(0)), and _StridedShard._shard_tensor requires the dim to
# split evenly: a Linear(2, 3) (3 rows over 2 TP ranks) raises a bare AssertionError; Linear(2, 4)
# loads. The same uneven param trains, saves and loads through DCP fine.
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
results = {}
for rows in (4, 3):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, rows, bias=False)
    full = {k: v.clone() for k, v in m.state_dict().items()}
    parallelize_module(m, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(m, mesh=mesh["dp"])
    try:
        set_model_state_dict(m, dict(full), options=StateDictOptions(full_state_dict=True))  # it rewrites the dict
        got = m.weight.full_tensor()
        results[rows] = "ok" if torch.equal(got, full["weight"]) else "WRONG VALUES"
    except AssertionError as e:
        results[rows] = f"AssertionError({e})"
    if rank == 0:
        print(f"Linear(2, {rows}) colwise on 2 TP ranks, placements {m.weight.placements}: {results[rows]}", flush=True)
bad = results[3] != "ok"
if rank == 0:
    print("BUG: the full-state-dict load refuses an unevenly TP-split param" if bad else "OK", flush=True)
sys.stdout.flush(); os._exit(1 if bad else 0)
