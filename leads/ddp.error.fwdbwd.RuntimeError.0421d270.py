#!/usr/bin/env python
"""error parity: only the sharded run raises, in step 0: forward/backward: RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED at '/__w/pytorch/pytorch/torch/csrc/distributed/c10d/reducer.cpp':1732, please report a bug to PyTorch.

Run: torchrun --nproc-per-node 1 THIS_FILE.py [--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)
Needs only torch; found with torch 2.13.0+cpu, gloo, on cpu. Trains the case with ddp and runs it and lets torch's error
show.
"""

import datetime, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.tensor import DTensor
import contextlib
from torch.nn.parallel import DistributedDataParallel as DDP

if "--setup" in sys.argv:  # a Python file run first (a patch of torch, e.g. a planted bug)
    setup = sys.argv[sys.argv.index("--setup") + 1]; exec(compile(open(setup).read(), setup, "exec"), {"__name__": "__setup__", "__file__": setup})
torch.set_num_threads(1)
device = torch.device("cpu")  # the case's device (cuda: one GPU per rank, NCCL)
if device.type == "cuda": torch.cuda.set_device(device)
dist.init_process_group({"cpu": "gloo", "cuda": "nccl"}[device.type], timeout=datetime.timedelta(seconds=120))  # a hang fails
rank = dist.get_rank()
sys.excepthook = lambda kind, err, tb: (  # an error anywhere below is a finding: said, then its traceback
    print(f"FINDING: rank {rank}: {kind.__name__}: {err}", flush=True), sys.__excepthook__(kind, err, tb), os._exit(1))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(1, 1, bias=False))
    def forward(self, x):
        return self.layers(x)

def build(seed):  # the same seed, the same initial params
    torch.manual_seed(seed)
    return Net().to(device, torch.float32)

def batch(k):  # step k's global inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(k + 1)
    return torch.randn(2, 1, 1, generator=g).to(device, torch.float32), torch.randn(2, 1, 1, generator=g).to(device, torch.float32)

# the sharded run on 1 rank(s)
model = build(0)
ddp = DDP(model, static_graph=True)  # averages the grads
opt = torch.optim.Adam(model.parameters(), foreach=True)
k = 0
opt.zero_grad(set_to_none=False)
x, y = batch(k)
for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):  # grad accumulation
    with (contextlib.nullcontext() if i == 1 else ddp.no_sync()):  # accumulate, sync on the last
        part = ((ddp(xm) - ym) ** 2).mean() / 2
        part.backward()
        loss = part.detach() + (loss if i else 0)
opt.step()

if rank == 0:
    print("PASS: it ran through")
fail = []

sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there
