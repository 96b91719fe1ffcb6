"""Planted bug: a DCP save of a DTensor sharded on dim 0 with three dims (an MoE's grouped experts, w1 / w2 / w3
[E, hidden, dim], Shard(0) over the ep mesh, and their optimizer state) writes each rank's chunk at the mirrored
expert offset (E - offset - size: the ep ranks' order reversed), the local expert index mapped to the global one
from the wrong end. The chunks still cover the tensor once, so the save's global plan validates and nothing raises;
whatever loads it (any world size, any EP degree) gets the experts in another order. An EP degree of 1 (one chunk)
hides it, and so does a full state dict (gathered, not written by chunk)."""
from torch.distributed.checkpoint import planner_helpers
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

_orig = planner_helpers._create_write_items_for_dtensor


def _create_write_items_for_dtensor(fqn, tensor):
    item = _orig(fqn, tensor)
    sharded0 = any(isinstance(p, (Shard, _StridedShard)) and p.dim == 0 for p in tensor.placements)
    if tensor.ndim == 3 and sharded0:
        chunk, size = item.tensor_data.chunk, item.tensor_data.size
        offsets = type(chunk.offsets)((size[0] - chunk.offsets[0] - chunk.sizes[0], *chunk.offsets[1:]))
        chunk.offsets = offsets
        item = type(item)(index=type(item.index)(fqn, offsets), type=item.type, tensor_data=item.tensor_data)
    return item


planner_helpers._create_write_items_for_dtensor = _create_write_items_for_dtensor
