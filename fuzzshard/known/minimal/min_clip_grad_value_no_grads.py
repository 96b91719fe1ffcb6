# torchrun --nproc-per-node 2 min_clip_grad_value_no_grads.py
# torch.nn.utils.clip_grad_value_ raises on parameters none of which has a grad:
#     RuntimeError: Expected !nested_tensorlist[0].empty() to be true, but got false.
# where clip_grad_norm_, get_total_norm and clip_grads_with_norm_ return early for no grads
# (clip_grad.py:81 and :158 in torch 2.13.0: `if len(tensors) == 0` / `if len(grads) == 0`).
# clip_grad_value_ (clip_grad.py:281-283) hands the empty list to _group_tensors_by_device_and_dtype,
# whose C++ side refuses an empty tensor list. A training loop meets it under FSDP1 with
# use_orig_params=True: a rank that holds no element of any param (fewer elements than ranks, or only
# padding in its shard) has p.grad None for every param, so the usual
# clip_grad_value_(model.parameters(), v) raises on that rank alone while the others go on.
# Seen on torch 2.13.0 (CPU, gloo).
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
model = FSDP(torch.nn.Linear(1, 1, bias=False), use_orig_params=True, device_id=torch.device("cpu"))
model(torch.randn(4, 1)).sum().backward()
grads = [p.grad is not None for p in model.parameters()]
err = None
try:
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
except RuntimeError as e:
    err = e
print(f"rank {rank}: params with a grad {grads}; clip_grad_value_: {str(err).splitlines()[0] if err else 'ok'}",
      flush=True)
norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is None], 0.5)  # 0.0: no raise
bad = torch.tensor([1 if err else 0])
dist.all_reduce(bad)
if rank == 0:
    print("BUG REPRODUCED" if bad.item() else "ok")
dist.destroy_process_group()
sys.exit(1 if bad.item() else 0)  # exit 1: bug reproduced
