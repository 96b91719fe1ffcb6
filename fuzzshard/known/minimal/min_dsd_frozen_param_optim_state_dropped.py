# torchrun --nproc-per-node 1 min_dsd_frozen_param_optim_state_dropped.py
# A param that has Adam state in the checkpoint but is frozen (requires_grad=False) when the optimizer
# is loaded: set_optimizer_state_dict (in-memory or full) and a DCP resume leave it with no state at all,
# where plain Optimizer.load_state_dict restores it; unfreezing it later restarts Adam from step 0.
import copy, shutil, sys, tempfile, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(4, 2)


def make():
    torch.manual_seed(1)
    m = torch.nn.Linear(2, 2)
    return m, torch.optim.Adam(m.parameters(), lr=0.01)


m, opt = make()
m(x).sum().backward(); opt.step(); opt.zero_grad()   # step 1: weight and bias get Adam state
m.weight.requires_grad_(False)                     # weight frozen, checkpoint taken now
res = {}
m2, o2 = make(); m2.weight.requires_grad_(False)   # resume: same freezing as at save time
o2.load_state_dict(copy.deepcopy(opt.state_dict())); res["plain Optimizer.load_state_dict"] = o2
for name, opts in (("in-memory", StateDictOptions()), ("full_state_dict", StateDictOptions(full_state_dict=True))):
    m2, o2 = make(); m2.weight.requires_grad_(False)
    set_optimizer_state_dict(m2, o2, copy.deepcopy(get_optimizer_state_dict(m, opt, options=opts)), options=opts)
    res[f"DSD set_optimizer_state_dict, {name}"] = o2
ckpt = tempfile.mkdtemp() if rank == 0 else None
ckpt = [ckpt]; dist.broadcast_object_list(ckpt); ckpt = ckpt[0]
dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=ckpt)
m2, o2 = make(); m2.weight.requires_grad_(False)
sd = {"optim": get_optimizer_state_dict(m2, o2)}   # fresh optimizer: no key for the frozen weight
dcp.load(sd, checkpoint_id=ckpt); set_optimizer_state_dict(m2, o2, sd["optim"])
res["DCP save/load + set_optimizer_state_dict"] = o2
saved = opt.state[m.weight]
bad = False
if rank == 0:
    print(f"saved Adam state of the frozen weight: {sorted(saved)}, step={saved['step'].item()}")
for k, o in res.items():
    p = o.param_groups[0]["params"][0]            # the frozen weight
    st = o.state.get(p, {})
    bad |= "step" not in st
    line = f"  {k}: loaded state {sorted(st)}" + (f", step={st['step'].item()}" if "step" in st else "")
    p.requires_grad_(True); p.grad = torch.ones_like(p); before = p.detach().clone(); o.step()   # unfreeze, step
    if rank == 0:
        print(f"{line}; after unfreeze+step, weight[0,0] moved by {(p - before)[0, 0].item():+.6f}")
if rank == 0:
    shutil.rmtree(ckpt, ignore_errors=True)
    print("BUG REPRODUCED" if bad else "ok", flush=True)
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
