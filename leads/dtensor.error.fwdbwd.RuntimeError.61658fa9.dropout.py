#!/usr/bin/env python
"""error parity: only the sharded run raises, in step 0: forward/backward: RuntimeError: aten.bernoulli_.float: in-place operations that require placement changes are not supported. The input has placement (Partial(sum),), but no valid strategy preserves this placement. Please use the out-of-place version of this operation instead.

Run: torchrun --nproc-per-node 1 THIS_FILE.py [--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)
Needs only torch; found with torch 2.13.0+cpu, gloo, on cpu. Trains the case with dtensor and runs it and lets torch's
error show.
"""

import datetime, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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
        self.layers = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Dropout(0.5))
    def forward(self, x):
        return self.layers(x)

def build(seed):  # the same seed, the same initial params
    torch.manual_seed(seed)
    return Net().to(device, torch.float32)

def batch(k):  # step k's global inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(k + 1)
    return torch.randn(1, 1, 1, generator=g).to(device, torch.float32), torch.randn(1, 1, 1, generator=g).to(device, torch.float32)

# the sharded run on 1 rank(s)
model = build(0)
mesh = init_device_mesh(device.type, (1,))
layout = {'layers.0.weight': [Shard(1)]}  # the rest [Replicate()]
for name, p in list(model.named_parameters()):  # each param a DTensor
    owner, _, attr = name.rpartition(".")
    dt = distribute_tensor(p.detach(), mesh, layout.get(name, [Replicate()]))
    setattr(model.get_submodule(owner), attr, nn.Parameter(dt))
opt = torch.optim.SGD(model.parameters(), foreach=True)
k = 0
opt.zero_grad(set_to_none=False)
x, y = batch(k)
torch.manual_seed((0 * 1000 + k) * 1000 + 0 + 1)  # dropout: every rank draws alike
loss = ((model(distribute_tensor(x, mesh, [Replicate()])) - distribute_tensor(y, mesh, [Replicate()])) ** 2).mean()
loss.backward()
opt.step()

if rank == 0:
    print("PASS: it ran through")
fail = []

sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there
