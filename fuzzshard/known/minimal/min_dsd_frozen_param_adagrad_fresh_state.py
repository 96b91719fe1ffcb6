# torchrun --nproc-per-node 1 min_dsd_frozen_param_adagrad_fresh_state.py   (gloo, CPU; also runs with 2 ranks)
# Adagrad keeps state (step, sum) from its constructor. A param trained 3 steps and frozen before the
# checkpoint: set_optimizer_state_dict(full / broadcast) with the param still frozen gives it the FRESH
# optimizer's step=0, sum=0 (saved: step=3); the in-memory load leaves it stateless (Adagrad re-inits lazily: step restarts at 0).
import warnings; warnings.filterwarnings("ignore")
import copy, sys, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions as O, get_optimizer_state_dict, set_optimizer_state_dict
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
def make(opt_cls):
    torch.manual_seed(1); m = torch.nn.Linear(2, 2)
    return m, opt_cls(m.parameters(), lr=0.01)
def train(opt_cls):
    m, o = make(opt_cls)
    for _ in range(3):
        m(torch.ones(4, 2)).sum().backward(); o.step(); o.zero_grad()
    m.weight.requires_grad_(False)                  # frozen, then checkpointed
    return m, o
def show(o, p):
    st = o.state.get(p, {})
    return f"{sorted(st)} step={st['step'].item():g} sum[0,0]={st['sum'][0,0].item():.3g}" if "sum" in st else \
           (f"{sorted(st)} step={st['step'].item():g}" if "step" in st else f"{sorted(st)} (no state)")
m, o = train(torch.optim.Adagrad)
if rank == 0: print(f"saved Adagrad state of frozen weight: {show(o, m.weight)}")
opts = {"in-memory": O(), "full": O(full_state_dict=True), "broadcast": O(full_state_dict=True, broadcast_from_rank0=True)}
bad = 0
for name, op in opts.items():
    for freeze_first in (True, False):
        sd = copy.deepcopy(get_optimizer_state_dict(m, o, options=op)) if (rank == 0 or name != "broadcast") else {}
        m2, o2 = make(torch.optim.Adagrad)
        if freeze_first: m2.weight.requires_grad_(False)
        set_optimizer_state_dict(m2, o2, sd, options=op)
        m2.weight.requires_grad_(False)
        line = show(o2, m2.weight); ok = "step=3" in line
        bad += (not ok) and freeze_first
        if rank == 0: print(f"  {name:9s} load, weight {'frozen  ' if freeze_first else 'trainable'} at load: {line} {'ok' if ok else 'WRONG'}")
        if freeze_first and name == "in-memory":   # unfreeze and step: stateless param
            m2.weight.requires_grad_(True); m2.weight.grad = torch.ones(2, 2)
            try: o2.step(); r = "ok"
            except Exception as e: r = f"{type(e).__name__}: {e}"
            if rank == 0: print(f"    unfreeze + step after in-memory load: {r}, state now {show(o2, m2.weight)}")
# Adam (lazy state) for comparison: the frozen param comes back stateless (known face: loaded.state.missing)
m, o = train(torch.optim.Adam); m2, o2 = make(torch.optim.Adam); m2.weight.requires_grad_(False)
set_optimizer_state_dict(m2, o2, copy.deepcopy(get_optimizer_state_dict(m, o, options=opts["full"])), options=opts["full"])
if rank == 0: print(f"Adam full load, frozen: saved {show(o, m.weight)} -> loaded {show(o2, m2.weight)}")
if rank == 0: print("BUG REPRODUCED" if bad else "ok", flush=True)
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
