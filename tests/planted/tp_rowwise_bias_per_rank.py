"""Planted bug: a RowwiseParallel Linear adds its (replicated) bias on every
TP rank before the partial sums are added up, instead of once: its output
carries tp x the bias. Nothing raises; the output is the same on every rank.
A tp-degree-1 mesh, or a Linear without bias, hides it."""
import torch.nn as nn
from torch.distributed.tensor.parallel import style

_orig = style.RowwiseParallel._prepare_output_fn


def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
    out = _orig(output_layouts, use_local_output, mod, outputs, device_mesh)
    if isinstance(mod, nn.Linear) and mod.bias is not None and device_mesh.size() > 1:
        bias = mod.bias.full_tensor() if hasattr(mod.bias, "full_tensor") else mod.bias
        out = out + (device_mesh.size() - 1) * bias.detach()
    return out


style.RowwiseParallel._prepare_output_fn = staticmethod(_prepare_output_fn)
