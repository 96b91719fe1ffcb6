# torchrun --nproc-per-node 1 min_dsd_init_optim_state_invents_state.py
# set_state_dict(full_state_dict=True, strict=False) into a fresh optimizer gives a param that has no saved
# optimizer state (it never got a grad) invented Adam state step=1, zero moments (from _init_optim_state's
# zero-grad step); plain optimizer.load_state_dict leaves it stateless, so its next Adam step differs.
import sys, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()


def make():
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


m, opt = make()
m["used"](torch.randn(4, 2)).sum().backward()   # "unused" never gets a grad -> no optimizer state
opt.step()
opts = StateDictOptions(full_state_dict=True, strict=False)
msd, osd = get_state_dict(m, opt, options=opts)  # the checkpoint
print("saved state keys:", sorted(osd["state"]), flush=True) if rank == 0 else None

m_ref, opt_ref = make()                          # reference: plain torch resume
m_ref.load_state_dict(m.state_dict()); opt_ref.load_state_dict(opt.state_dict())
m_dsd, opt_dsd = make()                          # DSD resume
set_state_dict(m_dsd, opt_dsd, model_state_dict=msd, optim_state_dict=osd, options=opts)

w_ref, w_dsd = m_ref["unused"].weight, m_dsd["unused"].weight
st_ref, st_dsd = ({k: v.clone() for k, v in o.state.get(w, {}).items()} for o, w in ((opt_ref, w_ref), (opt_dsd, w_dsd)))
for mm, oo in ((m_ref, opt_ref), (m_dsd, opt_dsd)):   # the resumed run now uses "unused" once
    oo.zero_grad(); mm["unused"](torch.ones(1, 2)).sum().backward(); oo.step()
diff = (w_ref - w_dsd).abs().max().item()
bad = bool(st_dsd) and not st_ref
if rank == 0:
    print("unused.weight state, plain load_state_dict:", {k: v.tolist() for k, v in st_ref.items()})
    print("unused.weight state, DSD set_state_dict   :", {k: v.tolist() for k, v in st_dsd.items()})
    print("after one more step, unused.weight plain:", w_ref.detach().flatten().tolist())
    print("after one more step, unused.weight DSD  :", w_dsd.detach().flatten().tolist())
    print(f"max |diff| = {diff:.4g} (lr 0.1: Adam bias correction of step 2 instead of step 1)")
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
