# torchrun --nproc-per-node 1 min_fsdp2_frozen_unit_unfreeze_ac.py
# Root cause (fsdp2.error.fwdbwd.CheckpointError.bfe0c74e): a fully_shard unit whose params are all
# frozen is left UNSHARDED after backward, so the module attribute is the unsharded param. Unfreezing
# it the usual way (module.weight.requires_grad_(True)) sets the flag on the unsharded param only;
# FSDP2's sharded param stays frozen, and every later unshard (to_unsharded) copies requires_grad
# from it. A block under composable activation checkpointing that calls the unit twice runs its
# first call on the (unfrozen) unsharded param, reshards after forward, then re-unshards frozen:
# the forward and the recomputation save different numbers of tensors -> CheckpointError. The
# plain model (and the same FSDP2 model without checkpointing) trains fine.
import os, sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed._composable import checkpoint
torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))

    def forward(self, x):
        return self.inner(self.inner(x))   # the unit inner[0] runs twice


torch.manual_seed(0)
m = Net()
m.inner[0].weight.requires_grad_(False)
checkpoint(m.inner)
fully_shard(m.inner[0], mesh=mesh)
fully_shard(m, mesh=mesh)
fp = m.inner[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
x = torch.randn(2, 1)
bad = False
for step in range(3):
    if step == 2:
        print(f"before step 2: unit state {fp.sharded_state.name}, module.weight is the sharded param: "
              f"{m.inner[0].weight is fp.sharded_param}", flush=True)
        m.inner[0].weight.requires_grad_(True)   # unfreeze
        print(f"after unfreezing: sharded param requires_grad={fp.sharded_param.requires_grad}", flush=True)
    try:
        m(x).sum().backward()
    except Exception as e:
        print(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        bad = True
        break
print("BUG: the unfreeze misses FSDP2's sharded param; checkpoint recomputation differs" if bad else "OK", flush=True)
sys.stdout.flush(); os._exit(1 if bad else 0)
