# python min_composable_checkpoint_reruns_pre_hooks.py   (one process; ep's ExpertParallel meets it under torchrun)
# torch.distributed._composable.checkpoint(module) saves the module's inputs as its forward pre-hook sees them,
# after the forward pre-hooks registered before it (distribute_module's input_fn: EP's token dispatch) have
# transformed them, and recomputes by calling module(*inputs) with those hooks enabled: they transform the inputs
# a second time. Here the pre-hook doubles x: the forward runs on 2x, the recompute on 4x, and the grads are
# silently wrong; with EP's all-to-all dispatch the recompute saves another number of tensors (CheckpointError).
# torch.utils.checkpoint and checkpoint_wrapper on the same module give the plain grads.
import sys, torch, torch.nn as nn
from torch.distributed._composable import checkpoint


def grads(ac):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))  # an input transform (distribute_module's input_fn)
    if ac:
        checkpoint(m)
    m(torch.randn(4, 3)).sum().backward()
    return m[0].weight.grad


plain, checkpointed = grads(False), grads(True)
if not torch.equal(plain, checkpointed):
    print("BUG REPRODUCED: composable checkpoint's recompute re-ran the forward pre-hook:",
          f"max |grad diff| {(plain - checkpointed).abs().max().item():.3g}")
    sys.exit(1)   # exit 1: bug reproduced
print("ok")
