"""SequentialLR's state dict holds one tensor under two keys, so a DCP load (which loads in place) restores
only one of the two saved values: with a tensor lr, get_last_lr() right after the load is another
scheduler's last lr (0.0005 loaded where 0.0009 was saved below). Torch alone, one process, CPU, gloo:
    python min_sequentiallr_last_lr_aliased_dcp_load.py
SequentialLR.__init__ and .step set ``self._last_lr = schedulers[idx].get_last_lr()`` (lr_scheduler.py:1171
and 1196 in 2.13.0): the active child's own ``_last_lr`` list, not a copy. With a tensor lr its entries are
tensors (_param_groups_val_list clones group["lr"]), so ``state_dict()`` holds the same tensor as
``_last_lr`` and as ``_schedulers[idx]._last_lr``. A fresh SequentialLR aliases child 0; after a milestone
the saved one aliased child 1. torch.distributed.checkpoint.load copies each saved tensor into the state
dict's tensor in place (the Stateful pattern torchtitan uses for its schedulers): SequentialLR's
``_last_lr`` and child 0's ``_last_lr`` are one tensor, both saved values are written into it, and the last
write wins. A float lr is not affected (DCP replaces non-tensor values), nor torch.save/torch.load (it keeps
the aliasing). Seen on torch 2.13.0."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.optim.lr_scheduler import ConstantLR, ExponentialLR, SequentialLR

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
dist.init_process_group("gloo", rank=0, world_size=1)


def make():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=torch.tensor([0.001]))
    sched = SequentialLR(opt, [ConstantLR(opt, factor=0.5, total_iters=1), ExponentialLR(opt, gamma=0.9)],
                         milestones=[1])
    return opt, sched


opt, sched = make()
for _ in range(2):  # past the milestone: ExponentialLR is the active child
    opt.step()
    sched.step()
saved = sched.state_dict()
want = [float(v) for v in sched.get_last_lr()]
path = tempfile.mkdtemp()
dcp.save({"lr_scheduler": saved}, checkpoint_id=path)

opt2, sched2 = make()
sd = {"lr_scheduler": sched2.state_dict()}
print("fresh state dict: _last_lr is _schedulers[0]._last_lr:",
      sd["lr_scheduler"]["_last_lr"] is sd["lr_scheduler"]["_schedulers"][0]["_last_lr"])
dcp.load(sd, checkpoint_id=path)
sched2.load_state_dict(sd["lr_scheduler"])
got = [float(v) for v in sched2.get_last_lr()]
print(f"get_last_lr(): saved {want}, loaded {got}")
dist.destroy_process_group()
bad = got != want
print("BUG REPRODUCED" if bad else "ok")
sys.exit(1 if bad else 0)  # exit 1: bug reproduced
