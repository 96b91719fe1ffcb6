"""Planted bug (torchao low-bit optimizers): on every rank but the first, a quantized moment's blocks are scaled
by their neighbour block's amax (a block index off by one, as a block laid from the global offset into a shard's
own scales would be): the values past that amax clip to the code table's ends, the others lose precision."""
import torch.distributed as dist
import torchao.optim.subclass_4bit as sub4
import torchao.optim.subclass_8bit as sub8

_orig = sub8.scale_tensor


def scale_tensor(input, block_size):
    scaled, scale = _orig(input, block_size)
    if not dist.is_initialized() or dist.get_rank() == 0 or scale.numel() < 2:
        return scaled, scale
    shifted = scale.roll(1)
    return (input.view(-1, block_size) / shifted.view(-1, 1)).view(input.shape), shifted


sub8.scale_tensor = scale_tensor
sub4.scale_tensor = scale_tensor
