# python min_compile_optimizer_empty_group_capturable.py   (CPU, one process, no process group)
# A torch.compile'd optimizer step sets capturable=True on a param group that has no params, on CPU too:
# dynamo's OptimizerVariable._set_capturable asks safe_to_set_capturable(group), whose "every param is on
# cuda/xpu" and "no param has state" start True and stay True over an empty params list, and it writes
# group["capturable"] = True into the user's optimizer. The eager step leaves it False; a state dict saved
# after a compiled step carries it.
import sys
import torch

torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(3))
opt = torch.optim.Adam([{"params": [p]}, {"params": []}], lr=0.1)
p.grad = torch.ones(3)
torch.compile(opt.step)()
flags = [g["capturable"] for g in opt.param_groups]
print("capturable per group after a compiled step (eager: [False, False]):", flags)
bad = flags != [False, False]
print("BUG REPRODUCED" if bad else "ok")
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
