"""torchao 0.18.0 + torch 2.13.0: a DCP checkpoint of a low-bit AdamW's state (AdamW8bit) on FSDP2 params, saved at
one world size, does not load at another whose shards cut the saved blocks.

A Linear(8, 1024) weight saved over 2 ranks holds each rank's 512 x 8 = 4096 elements as OptimState8bit (16 blocks
of 256). Loaded over 3 ranks (rows 342 + 342 + 340), DCP narrows each saved shard to the rows a loading rank needs:
OptimState8bit's aten.slice wants both ends on a block boundary and raises "ValueError: Invalid start or end for
shape=torch.Size([512, 8]) and block_size=256 ... start=0, end=342". Loaded over 1 rank (every block whole) it
loads. The step runs eagerly (torch.compile the identity inside torchao.optim.adam: a C++ build per shape on CPU).

    torchrun --nproc-per-node 2 lowbit_dcp_reshard_unaligned.py save /tmp/ckpt
    torchrun --nproc-per-node 3 lowbit_dcp_reshard_unaligned.py load /tmp/ckpt   # raises on every rank
"""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torchao.optim
import torchao.optim.adam as adam
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class EagerTorch:
    def __getattr__(self, key):
        return getattr(torch, key)

    compile = staticmethod(lambda fn, **kwargs: fn)


adam.torch = EagerTorch()
mode, path = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Linear(8, 1024, bias=False)
fully_shard(model, mesh=mesh)
opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-2)
model(torch.randn(4, 8)).square().mean().backward()
opt.step()
state = {"optim": get_optimizer_state_dict(model, opt)}
if mode == "save":
    dcp.save(state, checkpoint_id=path)
else:
    dcp.load(state, checkpoint_id=path)  # 3 ranks: ValueError from OptimState8bit's aten.slice
    set_optimizer_state_dict(model, opt, state["optim"])
print(f"rank {dist.get_rank()}: {mode} done")
dist.destroy_process_group()
