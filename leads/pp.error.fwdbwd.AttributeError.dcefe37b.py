#!/usr/bin/env python
"""error parity: only the sharded run raises, in step 0: forward/backward: AttributeError: '_GeneratorContextManager' object has no attribute 'args'

Run: torchrun --nproc-per-node 1 THIS_FILE.py [--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)
Needs only torch; found with torch 2.13.0+cpu, gloo, on cpu. Trains the case with pp and runs it and lets torch's error
show.
"""

import datetime, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
from torch.distributed._composable import checkpoint

if "--setup" in sys.argv:  # a Python file run first (a patch of torch, e.g. a planted bug)
    setup = sys.argv[sys.argv.index("--setup") + 1]; exec(compile(open(setup).read(), setup, "exec"), {"__name__": "__setup__", "__file__": setup})
torch.set_num_threads(1)
device = torch.device("cpu")  # the case's device (cuda: one GPU per rank, NCCL)
if device.type == "cuda": torch.cuda.set_device(device)
dist.init_process_group({"cpu": "gloo", "cuda": "nccl"}[device.type], timeout=datetime.timedelta(seconds=120))  # a hang fails
rank = dist.get_rank()
sys.excepthook = lambda kind, err, tb: (  # an error anywhere below is a finding: said, then its traceback
    print(f"FINDING: rank {rank}: {kind.__name__}: {err}", flush=True), sys.__excepthook__(kind, err, tb), os._exit(1))

class Conv(nn.Module):  # Conv1d over the sequence axis of a [batch, seq, features] activation
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.conv = nn.Conv1d(*args, **kwargs)
    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Embedding(1, 2), nn.LayerNorm(2, bias=False), Conv(2, 1, 1, padding=0, bias=False), nn.Linear(1, 1, bias=False))
    def forward(self, x):
        return self.layers(x)

def build(seed):  # the same seed, the same initial params
    torch.manual_seed(seed)
    return Net().to(device, torch.float32)

def batch(k):  # step k's global inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(6658000 + k + 1)
    return torch.randint(0, 1, (1, 1), generator=g).to(device), torch.randn(1, 1, 1, generator=g).to(device, torch.float32)

# the sharded run on 1 rank(s)
model = build(6658)
checkpoint(model.layers[3])  # composable activation checkpointing
cuts = [0, 3, 4]  # stage s: model.layers[cuts[s]:cuts[s + 1]]
on = [0, 0]  # the rank of each stage (two a rank, V-shaped, as ScheduleZBVZeroBubble places them)
stages = [PipelineStage(model.layers[cuts[s]:cuts[s + 1]], s, 2, device) for s in range(2) if on[s] == rank]
def loss_fn(out, y):  # each microbatch's loss
    return ((out - y) ** 2).mean()
schedule = ScheduleZBVZeroBubble(stages, n_microbatches=1, loss_fn=loss_fn, scale_grads=False)
own = {n: q for n, q in model.named_parameters() if any(q is p for st in stages for p in st.submod.parameters())}  # this rank's params
kept = [0]  # the case's one group, over this rank's params
opt = torch.optim.Adam(list(own.values()), foreach=True)
k = 0
opt.zero_grad(set_to_none=False)
x, y = batch(k)
if rank == 0:  # the schedule's step: the inputs on the first stage's rank, the targets everywhere
    schedule.step(x, target=y)
else:
    schedule.step(target=y)
opt.step()

if rank == 0:
    print("PASS: it ran through")
fail = []

sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there
