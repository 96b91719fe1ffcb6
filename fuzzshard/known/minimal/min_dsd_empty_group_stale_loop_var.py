# torchrun --nproc-per-node 1 min_dsd_empty_group_stale_loop_var.py
# An optimizer with an empty param group that is not the last group: set_optimizer_state_dict never
# restores that group's saved hyperparameters. Full load: it keeps the fresh optimizer's lr; sharded
# (DCP-style) load: the group ends up with no 'lr'/'momentum' at all (KeyError at the next step()).
import sys, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)


def make(lr_empty):   # groups: [weight], [] (empty), [bias]
    m = torch.nn.Linear(2, 2)
    o = torch.optim.SGD([{"params": [m.weight]}, {"params": [], "lr": lr_empty}, {"params": [m.bias]}],
                        lr=0.1, momentum=0.9)
    return m, o


m, opt = make(lr_empty=0.5)   # saved run: the empty group's lr is 0.5 (e.g. set by a scheduler)
m(torch.randn(4, 2)).sum().backward(); opt.step()
res = {}
ref_opt = make(lr_empty=0.001)[1]; ref_opt.load_state_dict(opt.state_dict())
res["plain Optimizer.load_state_dict"] = ref_opt.param_groups[1].get("lr")
for full in (True, False):
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=full))
    m2, opt2 = make(lr_empty=0.001)   # fresh run: lr 0.001 for the empty group
    set_optimizer_state_dict(m2, opt2, osd, options=StateDictOptions(full_state_dict=full))
    g = opt2.param_groups[1]
    try:
        m2(torch.randn(4, 2)).sum().backward(); opt2.step(); step = "ok"
    except KeyError as e:
        step = f"KeyError {e}"
    res[f"DSD set_optimizer_state_dict full_state_dict={full}"] = f"{g.get('lr')}  (missing keys {sorted(set(ref_opt.param_groups[1]) - set(g))}; next step(): {step})"
bad = any(not str(v).startswith("0.5") for v in res.values())
if rank == 0:
    print("empty group (group 1) lr after load; saved 0.5, fresh 0.001:")
    for k, v in res.items():
        print(f"  {k}: {v}")
    print("BUG REPRODUCED" if bad else "ok", flush=True)
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
