#!/usr/bin/env python
"""checkpoint round trip: loaded.state.extra of unused.bias (saved after step 0) differs: expected state [], got ['exp_avg', 'exp_avg_sq', 'step']; 2 mismatches in all

Run: torchrun --nproc-per-node 1 THIS_FILE.py [--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)
Needs only torch; found with torch 2.13.0+cpu, gloo, on cpu. Trains the case with ddp and compares the state right
before the save with the state right after the load (exactly).
"""

import datetime, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
import tempfile
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

if "--setup" in sys.argv:  # a Python file run first (a patch of torch, e.g. a planted bug)
    setup = sys.argv[sys.argv.index("--setup") + 1]; exec(compile(open(setup).read(), setup, "exec"), {"__name__": "__setup__", "__file__": setup})
torch.set_num_threads(1)
device = torch.device("cpu")  # the case's device (cuda: one GPU per rank, NCCL)
if device.type == "cuda": torch.cuda.set_device(device)
dist.init_process_group({"cpu": "gloo", "cuda": "nccl"}[device.type], timeout=datetime.timedelta(seconds=120))  # a hang fails
rank = dist.get_rank()
sys.excepthook = lambda kind, err, tb: (  # an error anywhere below is a finding: said, then its traceback
    print(f"FINDING: rank {rank}: {kind.__name__}: {err}", flush=True), sys.__excepthook__(kind, err, tb), os._exit(1))
dist.broadcast_object_list(ckpt := [tempfile.mkdtemp() if rank == 0 else None])  # one directory every rank sees
ckpt = ckpt[0]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(1, 1, bias=False))
        self.unused = nn.Linear(2, 3)  # never called: its params get no grad
    def forward(self, x):
        return self.layers(x)

def build(seed):  # the same seed, the same initial params
    torch.manual_seed(seed)
    return Net().to(device, torch.float32)

def batch(k):  # step k's global inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(k + 1)
    return torch.randn(1, 1, 1, generator=g).to(device, torch.float32), torch.randn(1, 1, 1, generator=g).to(device, torch.float32)

def snapshot(model, opt):  # full copies: params, optimizer state by (param, name), param groups
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else torch.as_tensor(t)).detach().clone()
    name = {q: n for n, q in model.named_parameters()}
    return ({n: full(q) for n, q in model.named_parameters()},
            {(name[q], k): full(v) for g in opt.param_groups for q in g["params"] for k, v in opt.state.get(q, {}).items()},
            [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()
              if k not in ("params", "param_names")} for g in opt.param_groups])

# the sharded run on 1 rank(s)
model = build(0)
ddp = DDP(model, find_unused_parameters=True)  # averages the grads
opt = torch.optim.Adam(model.parameters(), foreach=True)
k = 0
opt.zero_grad(set_to_none=False)
x, y = batch(k)
loss = ((ddp(x) - y) ** 2).mean()
loss.backward()
opt.step()
saved = snapshot(model, opt)
# save after step 0
msd, osd = get_state_dict(ddp, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save({"model": msd, "optim": osd}, f"{ckpt}/full.pt")
dist.barrier()  # the checkpoint is complete

# the loading side, on 1 rank(s): a fresh model (another seed) and optimizer (every lr halved), the load
model = build(1)
ddp = DDP(model, find_unused_parameters=True)  # averages the grads
opt = torch.optim.Adam(model.parameters(), lr=0.0005, foreach=True)
sd = torch.load(f"{ckpt}/full.pt")
set_state_dict(ddp, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=StateDictOptions(full_state_dict=True, strict=False))
loaded = snapshot(model, opt)

# the loaded state must equal the saved one
fail = []
if rank == 0:  # saved and loaded: (params, optimizer state, param groups)
    names = lambda state, n: sorted(k for m, k in state if m == n)
    fail += [f"state of {n}: saved {names(saved[1], n)}, loaded {names(loaded[1], n)}"
             for n in sorted({m for m, _ in saved[1]} ^ {m for m, _ in loaded[1]})]
    fail += [f"state {n}.{k}: saved {v.tolist()}, loaded {loaded[1][n, k].tolist()}" for (n, k), v in saved[1].items()
             if (n, k) in loaded[1] and not (v.dtype == loaded[1][n, k].dtype and torch.equal(v, loaded[1][n, k]))]
    print("\n".join(["FINDING: the load changed what was saved", *fail]) if fail else
          "PASS: the loaded state equals the saved one")

sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there
