"""Two planted bugs at once: the optimizer step skips weight decay of DTensor
params in the last group (skip_weight_decay.py), and a load gives every group
the first group's lr (ckpt_first_group_lr.py). One session must report each
as one finding: two files, however many optimizers and kinds each shows in."""
import os

here = os.path.dirname(os.path.abspath(__file__))
for name in ("skip_weight_decay.py", "ckpt_first_group_lr.py"):
    path = os.path.join(here, name)
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__fuzzshard_setup__", "__file__": path})
