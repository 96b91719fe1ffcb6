# torchrun --nproc-per-node 2 min_fsdp1_hsdp_sharded_optim_load.py
# The documented FSDP1 sharded optimizer checkpoint recipe (load_sharded_optimizer_state_dict +
# optim_state_dict_to_load) on a HYBRID_SHARD model: load_sharded_optimizer_state_dict splits each optimizer
# state over the WHOLE world (it finds a group only in a nested FSDP+TP ShardedTensor), but optim_state_dict_to_load
# regathers it over the (smaller) shard group only: states come back shifted and zero-filled; params load exactly.
import shutil, sys, tempfile, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
W = dist.get_world_size()   # 2 -> mesh (2, 1), model sd holds plain tensors; 4 -> mesh (2, 2), it holds DTensors
mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
path = [tempfile.mkdtemp() if rank == 0 else None]; dist.broadcast_object_list(path); path = path[0]

def build():
    torch.manual_seed(0)
    m = FSDP(torch.nn.Linear(2, 4, bias=False), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
             use_orig_params=True, device_id=torch.device("cpu"))
    return m, torch.optim.Adam(m.parameters(), lr=0.1)

model, opt = build()
model(torch.randn(3, 2, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward(); opt.step()
with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
    dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}, checkpoint_id=path)

model2, opt2 = build()   # the documented load recipe (load_sharded_optimizer_state_dict docstring)
with FSDP.state_dict_type(model2, StateDictType.SHARDED_STATE_DICT):
    sd = {"model": model2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model2.load_state_dict(sd["model"]); kind = type(sd["model"]["weight"]).__name__
    osd = load_sharded_optimizer_state_dict(sd["model"], "optim", dcp.FileSystemReader(path))["optim"]
    opt2.load_state_dict(FSDP.optim_state_dict_to_load(model2, opt2, osd))
want, got = opt.state[model.weight]["exp_avg"], opt2.state[model2.weight]["exp_avg"]
ok = torch.tensor(float(torch.equal(want, got) and torch.equal(model.weight, model2.weight)))
dist.all_reduce(ok, op=dist.ReduceOp.MIN); bad = ok.item() == 0
for r in range(W):
    if r == rank:
        print(f"rank {rank}: params equal after load: {torch.equal(model.weight, model2.weight)}")
        print(f"rank {rank}: exp_avg saved : {want.flatten().tolist()}")
        print(f"rank {rank}: exp_avg loaded: {got.flatten().tolist()}", flush=True)
    dist.barrier()
if rank == 0:
    print("model state dict holds:", kind, "(not a nested ShardedTensor -> no data-parallel group -> split over the world)")
    shutil.rmtree(path)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
