"""python min_ddp_powersgd_zero_matrix_nan.py: PowerSGD turns an all-zero gradient matrix into NaN (torch alone, one
process, gloo; torch 2.9.1 and 2.13.0 CPU).

A layer that goes unused for a whole iteration (DDP find_unused_parameters, grads kept as zeros by
zero_grad(set_to_none=False)) hands powerSGD_hook a zero matrix M. P = M Q = 0, and the rank-1 (<= 2)
orthogonalization, _orthogonalize_gram_schmidt with orthogonalization_epsilon 0 (the default), divides
the zero column by its zero norm: NaN. Its `except ZeroDivisionError` (meant to log and fill the column
with 0s) never runs: dividing a tensor by zero raises nothing. With gradient_as_bucket_view=True the
unused layer's .grad is a view of the bucket, so the NaN lands in it (without, DDP leaves a globally unused
param's grad alone; a used param whose grad is all zeros gets the NaN either way). Expected: the layer's
grad 0 (the average of zeros, as allreduce_hook gives); got: NaN, and the optimizer steps the weight to NaN."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29547")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3, bias=False), nn.Linear(3, 1, bias=False)

    def forward(self, x, skip):
        return self.out(x if skip else x + self.inner(x))


model = nn.parallel.DistributedDataParallel(Gated(), find_unused_parameters=True, gradient_as_bucket_view=True)
state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1,
                               min_compression_rate=0.0, use_error_feedback=False, warm_start=False)
model.register_comm_hook(state, powersgd.powerSGD_hook)
x = torch.randn(2, 3)
for it, skip in enumerate([False, True]):  # iteration 1: PowerSGD on, the inner layer unused
    model.zero_grad(set_to_none=False)
    model(x, skip).sum().backward()
g = model.module.inner.weight.grad
print("inner.weight.grad after iteration 1:", g.flatten().tolist())
dist.destroy_process_group()
if g.isnan().any():
    print("FAIL: PowerSGD made an all-zero grad NaN")
    raise SystemExit(1)
print("PASS")
