"""Planted bug: a RowwiseParallel Linear (attention's wo, the MLP's w2)
averages its partial sums over the TP ranks instead of adding them (DP's
averaging habit in a TP all-reduce): the block's output is 1/tp of what it
should be, on every rank alike, so nothing raises."""
import torch.nn as nn
from torch.distributed.tensor.parallel import style

_orig = style.RowwiseParallel._prepare_output_fn


def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
    out = _orig(output_layouts, use_local_output, mod, outputs, device_mesh)
    return out / device_mesh.size() if isinstance(mod, nn.Linear) else out


style.RowwiseParallel._prepare_output_fn = staticmethod(_prepare_output_fn)
