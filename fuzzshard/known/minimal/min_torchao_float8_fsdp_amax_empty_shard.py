# torchrun --nproc-per-node 2 min_torchao_float8_fsdp_amax_empty_shard.py
# FSDP2's float8 all-gather (torchao tensorwise, enable_fsdp_float8_all_gather; emulated on CPU) of a weight with
# fewer rows than ranks: a Linear(4, 1) over 2 ranks leaves rank 1 an empty [0, 4] shard.
# WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather takes the shard's amax with tensor_to_amax(shard,
# reduce_amax=True): torch.max(torch.abs(x)) of the empty local shard raises on rank 1 ('max(): Expected reduction
# dim to be specified for input.numel() == 0'), before the MAX all-reduce that would give it the other shards' amax
# (an empty shard's amax is 0). Not the unpadded all-gather of torchao-float8-uneven-all-gather: this raises before
# any all-gather. File in pytorch/ao (torchao 0.18.0).
import dataclasses

import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

dist.init_process_group("gloo")
rank, mesh = dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))  # (the (1, 4) weight: rows 1 + 0)
config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                             enable_fsdp_float8_all_gather=True)
convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn == "2")
fully_shard(model[2], mesh=mesh)
fully_shard(model, mesh=mesh)
bad, msg = 0, "forward ran"
try:
    model(torch.randn(4, 5)).square().mean().backward()
except RuntimeError as e:
    bad, msg = 1, f"BUG REPRODUCED: {str(e).splitlines()[0][:120]}"
print(f"rank {rank} (shard {tuple(model[2].weight.to_local().shape)}): {msg}", flush=True)
if bad:  # (the other rank waits in the all-reduce the raising rank never joins)
    import os
    os._exit(1)
dist.destroy_process_group()
