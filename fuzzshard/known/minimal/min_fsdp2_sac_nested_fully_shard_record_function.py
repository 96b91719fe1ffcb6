# torchrun --nproc-per-node 1 min_fsdp2_sac_nested_fully_shard_record_function.py
# Selective activation checkpointing (torch.utils.checkpoint with create_selective_checkpoint_contexts) of a
# module that holds a submodule with its own fully_shard: backward raises "profiler._record_function_enter_new
# .default invocation index N encountered during backward but not found in storage". FSDP2's hooks of the inner
# unit run inside the SAC region under torch.profiler.record_function (FSDP::pre_forward, FSDP::all_gather,
# ...); SAC counts those profiler ops like any other, and in the recompute the unit is already unsharded (its
# pre-backward ran), so its hooks record another number of them. Plain (non-selective) checkpointing of the
# same module, or SAC without the nested fully_shard, runs. Seen on a 1-rank mesh.
import sys, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint, CheckpointPolicy, create_selective_checkpoint_contexts
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))

class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

def policy(ctx, func, *args, **kwargs):  # save matmuls' outputs, recompute the rest (torchtitan's op SAC, simpler)
    return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

def run(selective: bool, nested: bool) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(FeedForward(), nn.Linear(4, 1))
    ff = model[0]
    kw = {"context_fn": lambda: create_selective_checkpoint_contexts(policy)} if selective else {}
    ff.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False, **kw))(ff.forward)
    if nested:
        fully_shard(ff.w3, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(2, 4)).sum().backward()
        return "ok"
    except RuntimeError as e:
        return f"raises: {str(e).splitlines()[0][:150]}"

plain, alone, bad = run(False, True), run(True, False), run(True, True)
if rank == 0:
    print("checkpoint, nested fully_shard:", plain)
    print("selective checkpoint, no nested fully_shard:", alone)
    print("selective checkpoint, nested fully_shard:", bad)
    print("BUG REPRODUCED" if bad != "ok" else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad != "ok" else 0)   # exit 1: bug reproduced
