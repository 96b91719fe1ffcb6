# torchrun --nproc-per-node 2 min_async_save_default_stager_sharded_tensor.py
# dcp.async_save of an FSDP1 sharded state dict (ShardedTensor values) raises whenever it stages through a
# DefaultStager, which is what async_save does by itself when no storage_writer is passed
# (async_save(sd, checkpoint_id=...)): StateDictStager._offload_tensor
# (torch/distributed/checkpoint/_state_dict_stager.py) calls x.data_ptr(), which ShardedTensor's
# __torch_function__ refuses ("torch function 'data_ptr' ... not supported for ShardedTensor!").
# dcp.save of the same state dict works, and so does async_save(storage_writer=FileSystemWriter(...)).
import sys, tempfile, torch, torch.distributed as dist
torch.set_num_threads(1)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
model = FSDP(torch.nn.Linear(4, 4), device_id=torch.device("cpu"), use_orig_params=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
msd, _ = get_state_dict(model, opt)  # FSDP1: SHARDED_STATE_DICT, ShardedTensor values
ckpt = [tempfile.mkdtemp() if rank == 0 else None]
dist.broadcast_object_list(ckpt)
results = {}
dcp.save({"model": msd}, checkpoint_id=f"{ckpt[0]}/blocking")
results["dcp.save"] = "ok"
try:
    dcp.async_save({"model": msd}, checkpoint_id=f"{ckpt[0]}/default").result()
    results["dcp.async_save(checkpoint_id=...)"] = "ok"
except Exception as e:
    results["dcp.async_save(checkpoint_id=...)"] = f"raises {type(e).__name__}: {str(e)[:100]}"
bad = results["dcp.async_save(checkpoint_id=...)"] != "ok"
if rank == 0:
    print(f"state dict values: {sorted({type(v).__name__ for v in msd.values()})}")
    for k, r in results.items():
        print(f"{k}: {r}")
    print("BUG REPRODUCED" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
