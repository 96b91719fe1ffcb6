# python min_composable_checkpoint_second_backward.py   (one process; pipelining's zero-bubble schedules meet it too)
# torch.distributed._composable.checkpoint(module): its recompute context is one _no_hook(module) instance, a
# single-use @contextmanager built once per forward, while non-reentrant checkpoint recomputes once per autograd
# graph task: a second backward through the same graph (retain_graph; pipelining's split backward, whose
# stage_backward_input runs autograd.grad(retain_graph=True) and stage_backward_weight a second autograd.grad)
# re-enters the spent context manager: "AttributeError: '_GeneratorContextManager' object has no attribute 'args'".
# torch.utils.checkpoint(use_reentrant=False) on the same module takes both backwards.
import sys, torch, torch.nn as nn
from torch.distributed._composable import checkpoint
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
checkpoint(m[1])
loss = m(torch.randn(3, 2)).sum()
loss.backward(retain_graph=True)
try:
    loss.backward()
except AttributeError as e:
    print("BUG REPRODUCED:", e)
    sys.exit(1)   # exit 1: bug reproduced
print("ok")
