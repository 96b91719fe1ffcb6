# torchrun --nproc-per-node 1 min_fsdp1_shared_0d_step.py
# FSDP.optim_state_dict (use_orig_params=False) gives every param of a FlatParameter the SAME 0-d 'step'
# tensor object. Loaded into a use_orig_params=True FSDP model, opt.step() bumps that one shared tensor
# once per param, so step counts run ahead (Adam bias correction silently wrong).
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
torch.set_num_threads(1); CPU = torch.device("cpu")
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(4, 2)

def train(model, opt, n):
    for _ in range(n):
        opt.zero_grad(); model(x).sum().backward(); opt.step()

# save side: 1 Adam step on FSDP(use_orig_params=False); Linear weight+bias share one FlatParameter
src = FSDP(torch.nn.Linear(2, 2), use_orig_params=False, device_id=CPU)
opt = torch.optim.Adam(src.parameters(), lr=0.1)
train(src, opt, 1)
osd = FSDP.optim_state_dict(src, opt)
shared = osd["state"]["weight"]["step"] is osd["state"]["bias"]["step"]

# load side: FSDP(use_orig_params=True), 2 more steps -> every param should be at step 3
dst = FSDP(torch.nn.Linear(2, 2), use_orig_params=True, device_id=CPU)
opt2 = torch.optim.Adam(dst.parameters(), lr=0.1)
opt2.load_state_dict(FSDP.optim_state_dict_to_load(dst, opt2, osd))
train(dst, opt2, 2)
steps = [s["step"].item() for s in opt2.state.values()]

# workaround: clone the 0-d states in the saved dict before loading
osd2 = FSDP.optim_state_dict(src, opt)
for s in osd2["state"].values():
    s["step"] = s["step"].clone()
dst2 = FSDP(torch.nn.Linear(2, 2), use_orig_params=True, device_id=CPU)
opt3 = torch.optim.Adam(dst2.parameters(), lr=0.1)
opt3.load_state_dict(FSDP.optim_state_dict_to_load(dst2, opt3, osd2))
train(dst2, opt3, 2)
steps_ok = [s["step"].item() for s in opt3.state.values()]

bad = shared or any(s != 3 for s in steps)
if rank == 0:
    print("saved osd: weight/bias 'step' is the same tensor object:", shared)
    print("expected step per param after 1 + 2 steps: 3.0")
    print("actual steps after loading:", steps)
    print("with the saved steps cloned first:", steps_ok)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
