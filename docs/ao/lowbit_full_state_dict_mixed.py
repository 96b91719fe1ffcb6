"""torchao 0.18.0 + torch 2.13.0: the full optimizer state dict of a low-bit AdamW (AdamW8bit here) on FSDP2 params
whose shards are quantized on some ranks only aborts the job.

torchao quantizes a rank's local shard only where it has >= 4096 elements in whole blocks (_AdamBase._new_buffer),
so a Linear(3072, 3) weight sharded over 2 ranks (rows 2 + 1: 6144 and 3072 elements) keeps OptimState8bit state on
rank 0 and a plain float32 tensor on rank 1. get_optimizer_state_dict(full_state_dict=True) calls full_tensor() on
each state; OptimState8bit implements the all-gather on its codes (uint8) and scales, rank 1 all-gathers its float32
shard: the sizes differ and gloo aborts (SIGABRT on rank 0: "Received data size doesn't match expected size"). A
sharded (DCP) save of the same state works; so does an even layout (every rank quantized, or none).

    torchrun --nproc-per-node 2 lowbit_full_state_dict_mixed.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torchao.optim
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Linear(3072, 3)
fully_shard(model, mesh=mesh)
opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-2)
model(torch.randn(4, 3072)).square().mean().backward()
# the step eagerly (torch.compile the identity inside torchao.optim.adam): compiled, rank 0 fails earlier, in the
# compiled step of the unevenly sharded bias (AssertionError: expected size 2==1, an Inductor size guard)
import torchao.optim.adam as adam  # noqa: E402


class EagerTorch:
    def __getattr__(self, key):
        return getattr(torch, key)

    compile = staticmethod(lambda fn, **kwargs: fn)


adam.torch = EagerTorch()
opt.step()
print(f"rank {dist.get_rank()}: exp_avg is {type(opt.state[model.weight]['exp_avg'].to_local()).__name__}")
sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
print(f"rank {dist.get_rank()}: full state dict taken (no abort)")
dist.destroy_process_group()
