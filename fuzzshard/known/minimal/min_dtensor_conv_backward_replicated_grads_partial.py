"""DTensor Conv1d with every param and the input Replicate: convolution_backward's sharding rule
(convolution_backward_rules in torch/distributed/tensor/_ops/_conv_ops.py, 2.12 and older) labels
grad_weight and grad_bias Partial(sum) whatever the input's placement, as if the batch were sharded.
The local grads are the whole grads on every rank, so the first reduction (full_tensor(), an optimizer
step mixing them with Replicate params, a redistribute) sums W copies: the grad comes out W times too
large, silently; a DCP save of an optimizer state built from it (SGD momentum) refuses the Partial
placement. torch 2.13 replaced the rule with a single-dim strategy (#179185) that keeps Replicate.
    torchrun --nproc-per-node 2 min_dtensor_conv_backward_replicated_grads_partial.py
Prints BUG and exits 1 while the bug is there."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
plain = nn.Conv1d(2, 3, 1)
x = torch.randn(4, 2, 5)
plain(x).sum().backward()
sharded = nn.Conv1d(2, 3, 1)
sharded.load_state_dict(plain.state_dict())
for name, p in list(sharded.named_parameters()):
    setattr(sharded, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
sharded(distribute_tensor(x, mesh, [Replicate()])).sum().backward()
bad = False
for name, p in sharded.named_parameters():
    got = p.grad.full_tensor()
    want = getattr(plain, name).grad
    ratio = (got.norm() / want.norm()).item()
    bad |= not torch.allclose(got, want)
    if rank == 0:
        print(f"{name}: grad placements {p.grad.placements}, |full grad| / |plain grad| = {ratio:.3f}")
if rank == 0:
    print(f"torch {torch.__version__}:", f"BUG: replicated conv grads are labelled Partial and come out {world}x"
          if bad else "OK", flush=True)
dist.destroy_process_group()
sys.exit(1 if bad else 0)
