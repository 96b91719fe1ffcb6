"""torchao findings (pytorch/ao; docs/ao/README.md): torchao 0.18.0's low-bit AdamW on a DTensor param (Shard(0) over
2 ranks, a 128 x 64 param: each local shard 64 x 64 = 4096 elements, so its state is quantized) on CPU, torch
2.13.0. Each optimizer alone in its process:
  AdamW8bit: steps (40 s for two steps: torch.compile of single_param_adam, fullgraph, dynamic=False)
All three step eagerly (torch.compile the identity inside torchao.optim.adam), as fuzzshard runs them.
  AdamW4bit: AssertionError: wrong number of dimensions1 for op: input (inside the compiled step; on 1 rank it steps)
  AdamWFp8:  AttributeError: 'OptimStateFp8' object has no attribute 'qmap' (in AOT autograd's subclass wrapper:
             OptimStateFp8's tensor_attrs are codes, scale; OptimState8bit/4bit's hold qmap)

    torchrun --nproc-per-node 2 lowbit_dtensor.py [AdamW8bit|AdamW4bit|AdamWFp8]
"""
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torchao.optim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
cls = getattr(torchao.optim, sys.argv[1] if len(sys.argv) > 1 else "AdamWFp8")
torch.manual_seed(0)
p = torch.nn.Parameter(distribute_tensor(torch.randn(128, 64), mesh, [Shard(0)]))
p.grad = distribute_tensor(torch.randn(128, 64), mesh, [Shard(0)])
opt = cls([p], lr=1e-2)
t = time.time()
try:
    opt.step()
    opt.step()
    print(f"rank {dist.get_rank()}: {cls.__name__} stepped in {time.time() - t:.1f}s")
except Exception:
    print(f"rank {dist.get_rank()}: {cls.__name__} raised:\n{traceback.format_exc()[-1500:]}")
dist.destroy_process_group()
