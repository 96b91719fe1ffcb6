"""Planted bug: ColwiseParallel averages its replicated input's grad over the
TP ranks instead of summing the partial products (DP's averaging habit in a
TP all-reduce): every layer in front of a colwise Linear gets 1/tp of its grad."""
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import style


class _Average(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.n, None


_orig = style.ColwiseParallel._prepare_input_fn


def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
    x = inputs[0]
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad:
        inputs = (_Average.apply(x, device_mesh.size()), *inputs[1:])
    return _orig(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


style.ColwiseParallel._prepare_input_fn = staticmethod(_prepare_input_fn)
