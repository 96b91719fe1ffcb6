"""Planted bug (torchao low-bit optimizers, a checkpoint's round trip): where a loaded quantized moment is copied
into the loading side's quantized state (DCP's load: the saved OptimState, narrowed to the overlap, copied into
the new shard's), the block scales land one block off (rolled by one), so each block's codes are read back with
its neighbour's amax: the loaded moments differ from the saved ones by far more than one code interval."""
import torch
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.optim.subclass_fp8 import OptimStateFp8

aten = torch.ops.aten


def _plant(cls):
    table = cls._ATEN_OP_TABLE[cls]
    orig = table[aten.copy_.default]

    def copy_(func, types, args, kwargs):
        dst, src = args[0], args[1]
        out = orig(func, types, args, kwargs)
        if isinstance(dst, cls) and isinstance(src, cls) and dst.scale.numel() > 1:
            dst.scale.copy_(src.scale.roll(1))
        return out

    table[aten.copy_.default] = copy_


for _cls in (OptimState8bit, OptimState4bit, OptimStateFp8):
    _plant(_cls)
