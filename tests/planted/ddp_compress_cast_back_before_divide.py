"""Planted bug: the float16/bfloat16 compression hooks cast the all-reduced sum
back into the bucket before dividing by the world size; the division then goes
to the compressed copy, and the bucket keeps the sum: every grad W times too big."""
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def _compress_hook(dtype, process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # cast back ...
        compressed.div_(group.size())  # ... before the division, which misses the bucket
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


default_hooks._compress_hook = _compress_hook
