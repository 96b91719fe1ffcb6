# torchrun --nproc-per-node 2 min_dsd_full_strict_missing_key.py
# Root cause: set_model_state_dict(..., StateDictOptions(full_state_dict=True, strict=True)) accepts a
# state dict that lacks a param. _load_model_state_dict builds a local state dict holding every model
# key (the model's own current values), distributes only the keys given into it, then
# state_dict.update(local_state_dict): the missing key is back, with the fresh value, before
# load_state_dict(strict=True) runs. The param silently keeps its fresh value (and the caller's dict
# is rewritten). A sharded (non-full) load and plain load_state_dict refuse the same dict.
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
saved = torch.nn.Linear(2, 3).state_dict()
del saved["weight"]   # a checkpoint without this param


def outcome(load):
    try:
        load()
        return "accepted"
    except RuntimeError as e:
        return "refused: " + str(e).strip().splitlines()[-1].strip()


res = {"plain load_state_dict(strict=True)": outcome(lambda: torch.nn.Linear(2, 3).load_state_dict(saved, strict=True))}
for name, wrap in (("plain module", lambda m: m), ("fully_shard", lambda m: fully_shard(m, mesh=mesh))):
    m = wrap(torch.nn.Linear(2, 3))
    res[f"DSD full, strict=True, {name}"] = outcome(lambda: set_model_state_dict(
        m, dict(saved), options=StateDictOptions(full_state_dict=True, strict=True)))
    res[f"DSD sharded, strict=True, {name}"] = outcome(lambda: set_model_state_dict(
        m, {"bias": get_model_state_dict(m)["bias"]}, options=StateDictOptions(strict=True)))
bad = any(k.startswith("DSD full") and v == "accepted" for k, v in res.items())
if rank == 0:
    for k, v in res.items():
        print(f"{k}: {v}")
    print("BUG: a strict full-state-dict load accepts a missing key" if bad else "OK", flush=True)
sys.stdout.flush(); os._exit(1 if bad else 0)
