"""A full (or broadcast) optimizer-state-dict load through torch.distributed.checkpoint.state_dict
raises "ValueError: Device mismatch" for an optimizer whose lr is a 1-element tensor on the CPU while
its params and state are on CUDA. torch.optim accepts that lr on any device (the fused CUDA kernels
take a CPU tensor lr), and the same round trip passes with a float lr, a 0-d CPU lr or a CUDA lr.

Root cause (state_dict.py, _load_optim_state_dict, the `elif info.full_state_dict:` branch): it
takes the device to load onto from every tensor of the optimizer's local state dict, param_groups
included (`tree_map_only(torch.Tensor, _device, local_state_dict)`), and raises on the second device
it meets. A 0-d lr slips through (`if t.dim() > 0`); a 1-element lr is a hyperparameter, not state,
and should not be probed. The same code on torch 2.11, 2.13 and 2.14.1. Torch alone, one GPU:
    python min_dsd_full_optim_load_cpu_tensor_lr_cuda.py
Prints BUG and exits 1 while the bug is there; exits 0 once a full load of that lr passes."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

if not torch.cuda.is_available():
    sys.exit("needs a CUDA device: the bug is a CPU lr beside CUDA state")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29634")
dist.init_process_group("nccl", rank=0, world_size=1)


def round_trip(lr, full: bool) -> str:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    m(torch.randn(3, 2, device="cuda")).sum().backward()
    opt.step()
    options = StateDictOptions(full_state_dict=full)
    try:
        set_optimizer_state_dict(m, opt, get_optimizer_state_dict(m, opt, options=options), options=options)
        return "ok"
    except ValueError as e:
        return f"ValueError: {e}"


results = {(name, full): round_trip(lr, full)
           for name, lr in (("float lr", 0.01), ("0-d CPU lr", torch.tensor(0.01)),
                            ("1-element CUDA lr", torch.tensor([0.01], device="cuda")),
                            ("1-element CPU lr", torch.tensor([0.01])))
           for full in (False, True)}
for (name, full), got in results.items():
    print(f"{name:18} {'full' if full else 'sharded'}: {got}")
bad = results[("1-element CPU lr", True)] != "ok"
print("BUG: a full optimizer load refuses a 1-element CPU tensor lr beside CUDA state ('Device mismatch')"
      if bad else "OK", flush=True)
dist.destroy_process_group()
sys.exit(1 if bad else 0)
