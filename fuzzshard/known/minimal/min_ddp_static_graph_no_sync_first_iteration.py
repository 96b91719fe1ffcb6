# torchrun --nproc-per-node 1 min_ddp_static_graph_no_sync_first_iteration.py
# DDP(static_graph=True) with gradient accumulation under no_sync() from the very first iteration: the first
# backward raises "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (reducer.cpp). Under no_sync, _post_forward
# skips prepare_for_backward(), yet _DDPSink.backward still queues static graph's one-shot delayed all-reduce,
# whose finalize_backward() asserts. pytorch/pytorch#143580; the fix PR #187732 says that past the assert the same
# regression stops all-reducing grads from the second iteration on. With a synced first iteration it trains.
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(1, 1, bias=False), static_graph=True)
x = torch.randn(2, 1)
try:
    with model.no_sync():  # the first microbatch of the first step, accumulated without a sync
        model(x[:1]).sum().backward()
    model(x[1:]).sum().backward()  # the last microbatch syncs
    result = "ok"
except RuntimeError as e:
    result = f"raises: {str(e).splitlines()[0][:120]}"
print(f"static_graph + no_sync() in the first iteration: {result}")
dist.destroy_process_group()
if result != "ok":
    print("BUG REPRODUCED")
    sys.exit(1)
