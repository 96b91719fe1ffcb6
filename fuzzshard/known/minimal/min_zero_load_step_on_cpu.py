"""ZeroRedundancyOptimizer.load_state_dict forces every 0-d state tensor (Adam's ``step``) onto the
CPU, after torch.optim's own load put it on the param's device for a fused or capturable group:
the next step of fused Adam raises "state_steps is on cpu"; capturable Adam/AdamW/ASGD trip their
device assertion; with a CPU tensor lr, fused Adam's CUDA kernel skips the device check and the
process aborts (illegal memory access). Upstream: pytorch/pytorch#124133. Torch alone, one GPU:
    python min_zero_load_step_on_cpu.py
(zero_redundancy_optimizer.py, load_state_dict: "Force zero-dimensional tensors (like Adam "step") on CPU")
Seen on torch 2.11.0+cu130 (H100); the code is the same in 2.13."""
import os

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29500")
dist.init_process_group("nccl", rank=0, world_size=1)  # gloo fails the same way
kw = dict(fused=True)  # or dict(foreach=True, capturable=True)


def make(seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(2, 2).cuda()
    return m, ZeRO(m.parameters(), optimizer_class=torch.optim.Adam, **kw)


m, o = make(0)
m(torch.randn(3, 2, device="cuda")).sum().backward()
o.step()
o.consolidate_state_dict(to=0)
sd = o.state_dict()
m2, o2 = make(1)
o2.load_state_dict(sd)
print("step after ZeRO load on:", [s["step"].device for s in o2.optim.state.values()], "(plain Adam: cuda:0)")
m2(torch.randn(3, 2, device="cuda")).sum().backward()
o2.step()  # RuntimeError: ... state_steps is on cpu ...
print("ok")
dist.destroy_process_group()
