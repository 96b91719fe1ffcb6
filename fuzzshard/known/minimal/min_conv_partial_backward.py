# torchrun --nproc-per-node 2 min_conv_partial_backward.py
# Companion to min_conv_partial_input.py: the backward handler has the same defect. Here the forward
# handler is patched to be correct (redistribute Partial input -> Replicate), yet grad_input of the conv
# is still wrong: convolution_backward gets Partial grad_output + Partial input, the single-dim strategy
# asks for redistribution and labels grad_input Replicate, the handler skips the redistribution.
import sys, torch, torch.distributed as dist
BAD = False
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
aten = torch.ops.aten
_h = DTensor._op_dispatcher._custom_op_handlers
_orig = _h[aten.convolution.default]
def _fwd_fixed(op, args, kwargs):   # forward patched to be correct, backward left as shipped
    x = args[0]
    if x.placements[0].is_partial():
        args = (x.redistribute(x.device_mesh, [Replicate()]),) + tuple(args[1:])
    return _orig(op, args, kwargs)
_h[aten.convolution.default] = _fwd_fixed

dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
x = torch.randn(3, 4, 5); w1 = torch.randn(4, 4); wc = torch.randn(6, 4, 1); w2 = torch.randn(8, 6)
def f(x, w1, wc, w2):
    h = F.linear(x.transpose(1, 2), w1).transpose(1, 2)        # w1 Shard(1) -> h Partial
    o = F.conv1d(h, wc).transpose(1, 2)                          # conv on a Partial input
    return F.linear(o, w2).pow(2).mean()                         # w2 Shard(0) -> conv grad_output Partial
p = [t.clone().requires_grad_() for t in (w1, wc, w2)]
f(x, *p).backward()
d = [distribute_tensor(t, mesh, [pl]).requires_grad_() for t, pl in ((w1, Shard(1)), (wc, Replicate()), (w2, Shard(0)))]
loss = f(distribute_tensor(x, mesh, [Replicate()]), *d); loss.backward()
fl = loss.full_tensor(); g = [t.grad.full_tensor() for t in d]
if rank == 0:
    print("loss err", (fl - f(x, w1, wc, w2)).abs().item())
    for n, a, b in zip(("w1 (upstream of conv)", "conv weight", "w2"), g, p):
        print(f"grad {n:22s} max err {(a - b.grad).abs().max().item():.3e}  (max |grad| {b.grad.abs().max().item():.3e})")
    BAD = True if (g[0] - p[0].grad).abs().max() > 1e-4 * p[0].grad.abs().max() else False
    print("BUG REPRODUCED" if BAD else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if BAD else 0)   # exit 1: bug reproduced
