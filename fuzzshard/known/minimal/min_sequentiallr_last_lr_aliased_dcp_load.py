"""SequentialLR with a tensor lr: after dcp.load (in place, into a fresh scheduler's state_dict, as torchtitan's
and any Stateful's resume does), get_last_lr() is an earlier scheduler's stale lr, not the one saved.
Torch alone, one process, CPU:
    python min_sequentiallr_last_lr_aliased_dcp_load.py
SequentialLR keeps its child's list itself as its own: `self._last_lr = schedulers[idx].get_last_lr()` in
__init__ and step() (torch/optim/lr_scheduler.py:1171, :1196; get_last_lr returns the list, no copy), so its
state_dict holds ONE list under two keys, "_last_lr" and "_schedulers.<idx>._last_lr". A fresh scheduler's
alias is scheduler 0's; the saved one's (past a milestone) is scheduler 1's. A tensor lr's _last_lr holds
tensors (the schedulers clone group["lr"] precisely to avoid aliasing: _param_groups_val_list), which DCP
loads in place (torch/distributed/checkpoint/_traverse.py: a list holding tensors is traversed, one entry per
tensor): the fresh state dict's one set of tensors is written twice, with SequentialLR's saved lr and with
scheduler 0's stale one, and the stale one wins. A float lr's list is one pickled value that DCP replaces:
no aliasing, no bug; torch.save/torch.load keep the aliasing and load right. Seen on torch 2.13.0 (CPU)."""
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.optim.lr_scheduler import ConstantLR, ExponentialLR, SequentialLR


def make(lr):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=lr)
    return opt, SequentialLR(opt, [ConstantLR(opt, factor=0.5, total_iters=1), ExponentialLR(opt, gamma=0.5)],
                             milestones=[1])


BAD = False
for tensor_lr in (False, True):
    opt, sched = make(torch.tensor(1.0) if tensor_lr else 1.0)
    for _ in range(3):  # past the milestone: scheduler 1 (ExponentialLR) sets the lr, 0.25 after three steps
        opt.step()
        sched.step()
    saved = [float(v) for v in sched.get_last_lr()]
    with tempfile.TemporaryDirectory() as d:
        dcp.save({"sched": sched.state_dict()}, checkpoint_id=d, no_dist=True)
        opt2, fresh = make(torch.tensor(1.0) if tensor_lr else 1.0)
        sd = {"sched": fresh.state_dict()}
        dcp.load(sd, checkpoint_id=d, no_dist=True)  # in place into the fresh state dict
        fresh.load_state_dict(sd["sched"])
    loaded = [float(v) for v in fresh.get_last_lr()]
    print(f"{'tensor' if tensor_lr else 'float'} lr: get_last_lr() saved {saved}, after dcp.load {loaded}")
    BAD |= loaded != saved
print("BUG REPRODUCED: SequentialLR's _last_lr is its child's list; DCP's in-place load of a tensor lr writes the "
      "stale child's lr into it" if BAD else "ok: the loaded scheduler reports the saved lr")
raise SystemExit(1 if BAD else 0)  # exit 1: bug reproduced
