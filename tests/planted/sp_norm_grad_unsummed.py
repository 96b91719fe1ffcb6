"""Planted bug: a SequenceParallel norm's weight grad misses the sum over the
TP ranks on the first TP rank. Each TP rank normalizes its own part of the
sequence, so the weight grad is a Partial sum over them; here TP rank 0 takes
its own partial as the whole grad (it still joins the all-reduce, so nothing
hangs), and its FSDP2 shard of the norm weight trains on part of the grad."""
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import style

_orig = style.SequenceParallel._apply


def _apply(self, module, device_mesh):
    out = _orig(self, module, device_mesh)

    def pre(mod, args):
        # the params the norm runs with this forward (FSDP2's unsharded ones, TP DTensors)
        for p in mod.parameters(recurse=False):
            if isinstance(p, DTensor) and p.requires_grad and not getattr(p, "_planted", False):
                p._planted = True
                p.register_hook(lambda g: _own_partial_on_rank0(g, device_mesh))

    module.register_forward_pre_hook(pre)
    return out


def _own_partial_on_rank0(g, tp_mesh):
    if not isinstance(g, DTensor) or not any(p.is_partial() for p in g.placements):
        return g
    summed = g.redistribute(placements=[Replicate()] * g.device_mesh.ndim)
    if tp_mesh.get_local_rank() == 0:
        return DTensor.from_local(g.to_local(), g.device_mesh, summed.placements, run_check=False)
    return summed


style.SequenceParallel._apply = _apply
