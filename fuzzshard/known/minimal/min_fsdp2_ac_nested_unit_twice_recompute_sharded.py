# torchrun --nproc-per-node 2 min_fsdp2_ac_nested_unit_twice_recompute_sharded.py
# torch <= 2.9: a module under non-reentrant activation checkpointing that holds a nested fully_shard unit and is
# called twice before one backward: the second call's backward runs the unit's post_backward, which reshards it;
# the first call's recompute then enters FSDPState._pre_forward in PRE_BACKWARD state, which returns early ("the
# pre-backward hook is responsible for the unshard") without unsharding, so the Linear sees its sharded DTensor
# weight beside a plain input: "aten.addmm.default: got mixed torch.Tensor and DTensor". 2.13.0's _pre_forward
# unshards a resharded group there (pytorch/pytorch#153354, fix PR #171779).
import sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 7), nn.GELU(), nn.Linear(7, 3))
    def forward(self, x):  # the checkpointed block, called twice
        ck = lambda h: checkpoint(self.block, h, use_reentrant=False)
        return ck(ck(x))
model = Twice()
fully_shard(model.block[0], mesh=mesh)      # a unit nested in the checkpointed block
fully_shard(model, mesh=mesh)
try:
    model(torch.randn(2, 3)).sum().backward()
    bad, what = False, "ok"
except RuntimeError as e:
    bad, what = True, f"raises RuntimeError: {str(e).splitlines()[0][:120]}"
if rank == 0:
    print(what); print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
