#!/usr/bin/env python
"""parity: grad of layers.0.weight after step 0 differs: |0.424| > 5.61e-05 at (0, 0) (max abs err 0.424, 1/1 elements; tolerance: reordered reductions of length <= 44 on both sides: 2*44 ulps of float32); 1 mismatches in all

Run: torchrun --nproc-per-node 1 THIS_FILE.py [--setup PATCH.py]  (exit 0: as expected; 1: the finding, printed)
Needs only torch; found with torch 2.13.0+cpu, gloo, on cpu. Trains the case with pp and replays each checked step on a
plain copy of the model, anchored on the sharded run's state, and compares within rounding bounds.
"""

import datetime, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

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
        self.layers = nn.Sequential(nn.Embedding(1, 1), nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False), nn.Linear(1, 2, bias=False), nn.LayerNorm(2, bias=False), nn.Linear(2, 1, bias=False), nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
        self.head = nn.Linear(1, 1, bias=False)
        self.head.weight = self.layers[0].weight  # tied: one Parameter in two modules
    def forward(self, x):
        return self.head(self.layers(x))

def build(seed):  # the same seed, the same initial params
    torch.manual_seed(seed)
    return Net().to(device, torch.float32)

def batch(k):  # step k's global inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(4000 + k + 1)
    return torch.randint(0, 1, (2, 1), generator=g).to(device), torch.randn(2, 1, 1, generator=g).to(device, torch.float32)

def gather(mine):  # {key: tensor} of every rank's own, merged on every rank (each param lives on one rank)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v if v is None else v.detach().clone() for k, v in mine.items()})
    return {k: v for part in parts for k, v in part.items()}

def snapshot(net, opt):  # params, optimizer state by (param, name), param groups (the pipeline's: gathered)
    name, piped = {q: n for n, q in net.named_parameters()}, net is model
    params = {n: q.detach().clone() for n, q in net.named_parameters() if not piped or n in own}
    state = {(name[q], k): torch.as_tensor(v).clone() for g in opt.param_groups for q in g["params"]
             for k, v in opt.state.get(q, {}).items()}
    hp = [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()
           if k not in ("params", "param_names")} for g in opt.param_groups]
    return (gather(params), gather(state), in_case_order(hp)) if piped else (params, state, hp)

def in_case_order(values):  # one value per group of this rank's optimizer -> one per case group, each from the
    held = [None] * dist.get_world_size()  # lowest rank that holds its params, else from one that holds it empty
    dist.all_gather_object(held, [(i, bool(g["params"]), v) for i, g, v in zip(kept, opt.param_groups, values)])
    first = {}
    for has in (True, False):
        for i, _, v in (t for part in held for t in part if t[1] == has):
            first.setdefault(i, v)
    return [first[i] for i in sorted(first)]

U = 2.0 ** -24  # unit roundoff of float32

def check(what, got, want, k, u=U, sens=0.0, extra=0.0):  # None if |got - want| <= k ulps of (max|want| + |want|) + k sens + extra
    if got is None or want is None or got.shape != want.shape:
        return None if got is None and want is None else f"{what}: sharded {got}, plain {want}"
    g, w, fin = got.double(), want.double(), got.isfinite() & want.isfinite()
    if not (fin | (g == w) | (g.isnan() & w.isnan())).all():
        return f"{what}: NaN or inf in one run only"
    g, w = g.where(fin, 0), w.where(fin, 0)
    err, bound = (g - w).abs(), k * u * (w.abs().max() + w.abs()) + k * sens + extra
    if (ok := err <= bound).all():
        return None
    i = int((err - bound).where(~ok, -1).argmax())
    return (f"{what}: sharded {g.flatten()[i].item():.8g}, plain {w.flatten()[i].item():.8g} at flat index {i}, "
            f"|diff| {err.flatten()[i].item():.3g} > allowed {bound.flatten()[i].item():.3g} ({int((~ok).sum())}/{w.numel()} off)")

# the sharded run on 1 rank(s)
model = build(4)
cuts = [0, 8, 9]  # stage s: model.layers[cuts[s]:cuts[s + 1]]
on = [0, 0]  # the rank of each stage (two a rank, V-shaped, as ScheduleDualPipeV places them)
stages = [PipelineStage((model.layers[cuts[s]:cuts[s + 1]] if s < 1 else nn.Sequential(*model.layers[cuts[s]:], model.head)), s, 2, device) for s in range(2) if on[s] == rank]
def loss_fn(out, y):  # each microbatch's loss
    return ((out - y) ** 2).mean()
schedule = ScheduleDualPipeV(stages, n_microbatches=2, loss_fn=loss_fn, scale_grads=True)
own = {n: q for n, q in model.named_parameters() if any(q is p for st in stages for p in st.submod.parameters())}  # this rank's params
kept = [0]  # the case's one group, over this rank's params
opt = torch.optim.Adam(list(own.values()), foreach=False)
got, after = [], [snapshot(model, opt)]  # per step: the grads, and the state after it
k = 0
opt.zero_grad(set_to_none=False)
x, y = batch(k)
if rank == 0:  # the schedule's step: the inputs on the first stage's rank, the targets everywhere
    schedule.step(x, target=y)
else:
    schedule.step(target=y)
got.append(gather({n: q.grad for n, q in own.items()}))
opt.step()
after.append(snapshot(model, opt))

# the plain model replays the step on the whole batch from the sharded run's state
GRAD_ULPS = 2 * 2 * 1 * 2 * 1 * 11  # the kernel's bound: reordered reductions of length <= 44 on both sides: 2*44 ulps of float32
plain = build(4)
p = dict(plain.named_parameters())
opt_p = torch.optim.Adam([p['layers.6.weight'], p['layers.5.weight'], p['layers.8.weight'], p['layers.3.weight'], p['layers.0.weight'], p['layers.4.weight'], p['layers.1.weight'], p['layers.2.weight'], p['layers.7.weight']], foreach=False)
fail = []
k = 0
opt_p.zero_grad(set_to_none=[False][k])
x, y = batch(k)
(sum(((plain(xm) - ym) ** 2).mean() for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))) / 2).backward()  # the whole batch, in the schedule's microbatches
fail += [check(f"step {k} grad {n}", got[k][n], q.grad, GRAD_ULPS)  # summed in another order
         for n, q in plain.named_parameters()]
fail = [f for f in fail if f]
if rank == 0:
    print("\n".join(["FINDING: the sharded run differs from the plain one", *fail]) if fail else
          "PASS: the sharded run matches the plain one")

sys.stdout.flush()
dist.destroy_process_group()
os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there
