# torchrun --nproc-per-node 2 min_fsdp1_optim_sd_cpu_aliased_states.py
# FSDP.optim_state_dict (use_orig_params=True, sharded, full optim state dict with its default offload_to_cpu=True)
# on CPU: all tensor states of a param are views of one reused all-gather buffer (.cpu() of a CPU tensor
# does not copy), so exp_avg silently holds exp_avg_sq (the last state gathered).
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullOptimStateDictConfig
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
torch.manual_seed(0); ref = torch.nn.Linear(2, 2)
torch.manual_seed(0); model = FSDP(torch.nn.Linear(2, 2), use_orig_params=True, device_id=torch.device("cpu"))
opts = []
for m in (ref, model):   # one Adam step, same data on every rank -> same grads as the plain model
    opts.append(torch.optim.Adam(m.parameters(), lr=0.1))
    m(x).sum().backward(); opts[-1].step()
want = opts[0].state[ref.weight]
got = FSDP.optim_state_dict(model, opts[1])["state"]["weight"]
FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT,   # workaround: no CPU offload -> clone path
                         optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False))
fixed = FSDP.optim_state_dict(model, opts[1])["state"]["weight"]
bad = not (torch.allclose(got["exp_avg"], want["exp_avg"]) and torch.allclose(got["exp_avg_sq"], want["exp_avg_sq"]))
if rank == 0:
    print("plain Adam   weight exp_avg:", want["exp_avg"].flatten().tolist(), "exp_avg_sq:", want["exp_avg_sq"].flatten().tolist())
    print("FSDP osd     weight exp_avg:", got["exp_avg"].flatten().tolist(), "exp_avg_sq:", got["exp_avg_sq"].flatten().tolist())
    print("offload_to_cpu=False weight exp_avg:", fixed["exp_avg"].flatten().tolist())
    print("exp_avg and exp_avg_sq share storage:", got["exp_avg"].data_ptr() == got["exp_avg_sq"].data_ptr())
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
