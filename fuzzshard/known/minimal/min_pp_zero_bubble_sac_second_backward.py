# python min_pp_zero_bubble_sac_second_backward.py   (one process: the schedules' split backward, called directly)
# Zero-bubble pipeline schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split a stage's backward in
# two: stage_backward_input (autograd.grad to the stage's inputs, retain_graph=True), then stage_backward_weight
# (autograd.grad to its weights through the same graph). A module of the stage under selective activation
# checkpointing (torch.utils.checkpoint with create_selective_checkpoint_contexts, as torchtitan's per-op SAC)
# allows one backward through its region: the weight pass raises "Trying to backward an extra time. You are
# only allowed to backward once on any region computed under selective activation checkpoint." Plain
# non-reentrant checkpointing of the same module takes both passes (it recomputes once per graph task).
import sys, torch, torch.nn as nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

torch.manual_seed(0)
lin = nn.Linear(2, 2, bias=False)


def save_mm(ctx, func, *args, **kwargs):  # torchtitan's policy in short: save the matmuls, recompute the rest
    return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


x = torch.randn(3, 2, requires_grad=True)  # the stage's input (received from the previous stage)
out = checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False,
                 context_fn=lambda: create_selective_checkpoint_contexts(save_mm))
loss = out.sum()  # the last stage's loss
_, param_groups = stage_backward_input([loss], None, [x], lin.parameters())  # I: the input grad, graph kept
try:
    stage_backward_weight(lin.parameters(), param_groups)  # W: the weight grads through the same graph
except RuntimeError as e:
    print("BUG REPRODUCED:", e)
    sys.exit(1)   # exit 1: bug reproduced
print("ok: weight grad", lin.weight.grad.flatten().tolist())
