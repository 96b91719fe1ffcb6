"""torchao 0.18.0 + torch 2.13.0: FSDP2's float8 all-gather (enable_fsdp_float8_all_gather) of an unevenly sharded
weight aborts: a Linear(5, 7) sharded over 2 ranks (rows 4 + 3), tensorwise float8, emulated on CPU. Rank 1 dies
in gloo: "op.preamble.length <= op.nbytes ... Received data size doesn't match expected size".
WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather has the one-argument (mesh) signature, for which FSDP2 skips
its padded-sharded-size check (_fsdp_param.py all_gather_inputs), and it returns the shard's float8 data unpadded;
the same model with even shards (Linear(5, 8)) trains in parity with the unsharded float8 model.

    torchrun --nproc-per-node 2 float8_uneven_all_gather.py
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                             enable_fsdp_float8_all_gather=True)
convert_to_float8_training(model, config=config)
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
model(torch.randn(4, 5)).square().mean().backward()  # rank 1 aborts in the float8 all-gather
print(f"rank {dist.get_rank()}: OK (no abort)")
dist.destroy_process_group()
