"""A torch lead (pytorch/pytorch, DTensor), met through torchao's float8 under TP: torch 2.13.0, a full reduction
(torch.max) of a Shard(0) DTensor whose local shard on some rank is empty raises on that rank ("max(): Expected
reduction dim to be specified for input.numel() == 0"), and the other ranks lose their peer. torchao's tensorwise
amax (float8_utils.tensor_to_amax: torch.max(torch.abs(x))) does this for a Float8ColwiseParallel weight with fewer
output features than TP ranks. The max of the non-empty shards is the answer the unsharded tensor gives.

    torchrun --nproc-per-node 2 dtensor_max_empty_local_shard.py
"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo"); mesh = init_device_mesh("cpu", (2,))
x = distribute_tensor(torch.randn(1, 4), mesh, [Shard(0)])  # rank 1's shard is empty
try:
    print(dist.get_rank(), "max", torch.max(torch.abs(x)).full_tensor().item())
except Exception as e:
    print(dist.get_rank(), "raised", str(e)[:150])
dist.destroy_process_group()
