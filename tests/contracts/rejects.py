"""Contracts with one documented answer each, checked under torchrun (1 rank,
gloo) rather than fuzzed: ZeroRedundancyOptimizer refuses malformed params
with a clear error (its docstring's TypeError / ValueError), its DDP-overlap
hooks refuse gloo and a ZeRO built without overlap_with_ddp, and FSDP1's
deprecated ``optim_input`` argument warns. Prints one line per broken contract."""
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

torch.set_num_threads(1)
dist.init_process_group("gloo")
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer as Zero  # noqa: E402

broken = []


def expect(exc, words, build, what):
    try:
        build()
    except exc as e:
        if not all(w in str(e) for w in words):
            broken.append(f"{what}: {type(e).__name__}: {e} (want a message naming {words})")
        return
    except Exception as e:  # noqa: BLE001 - any other type is the broken contract
        broken.append(f"{what}: {type(e).__name__}: {e} (want {exc.__name__})")
        return
    broken.append(f"{what}: accepted (want {exc.__name__})")


def zero(params):
    return lambda: Zero(params, optimizer_class=torch.optim.SGD, lr=0.1)


lin = nn.Linear(2, 2)
expect(ValueError, ["empty"], zero([]), "empty params")
expect(TypeError, ["iterable"], zero(lin.weight), "a bare tensor")
expect(TypeError, ["Tensors or dicts"], zero([1.0, 2.0]), "non-tensors")
expect(TypeError, ["Tensors or dicts"], zero([lin.weight, {"params": [lin.bias]}]), "tensors and dicts mixed")
expect(ValueError, ["params"], zero([{"lr": 0.1}]), "a group without params")
expect(ValueError, ["same dense type"], zero([lin.weight, nn.Parameter(torch.zeros(2, dtype=torch.float64))]), "mixed dtypes")
expect(ValueError, ["sparse"], zero([nn.Parameter(torch.zeros(2, 2).to_sparse())]), "sparse params")

# overlap_with_ddp: the DDP comm hooks that step ZeRO inside backward refuse gloo on purpose
# (it may hang, pytorch#62300); they need overlap_with_ddp=True. The NCCL path runs where a GPU is.
from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (  # noqa: E402
    hook_with_zero_step_interleaved, hook_with_zero_step)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ddp = DDP(nn.Linear(2, 2))
for hook in (hook_with_zero_step, hook_with_zero_step_interleaved):
    overlapped = Zero(ddp.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    expect(RuntimeError, ["Gloo"], lambda: hook(allreduce_hook, ddp, overlapped), f"{hook.__name__} on gloo")
    plain = Zero(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    expect(ValueError, ["overlap_with_ddp=True"], lambda: hook(allreduce_hook, ddp, plain),
           f"{hook.__name__} without overlap_with_ddp")

model = FSDP(nn.Linear(2, 2), device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    FSDP.full_optim_state_dict(model, opt, optim_input=list(model.parameters()))
if not any(issubclass(w.category, FutureWarning) and "optim_input" in str(w.message) for w in caught):
    broken.append("FSDP.full_optim_state_dict(optim_input=...): no FutureWarning naming optim_input")

print("\n".join(broken) or "OK")
dist.destroy_process_group()
sys.exit(1 if broken else 0)
