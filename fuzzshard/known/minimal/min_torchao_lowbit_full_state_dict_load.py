# torchrun --nproc-per-node 1 min_torchao_lowbit_full_state_dict_load.py   (both loads; 2 ranks: the plain one)
# torchao's low-bit AdamW (AdamW8bit, AdamW4bit, AdamWFp8) under FSDP2: a full optimizer state dict that saves fine
# (every rank's shard quantized, an even layout) cannot be loaded back. full_tensor() of the DTensor state gives the
# quantized subclass itself (OptimState8bit: codes and scales, not dequantized), so the full state dict holds it;
# set_optimizer_state_dict(full_state_dict=True) hands it to torch's collectives: broadcast_from_rank0=True
# broadcasts it from rank 0 (dist.broadcast: no c10d.broadcast_ in its dispatch, NotImplementedError; the other
# ranks wait in their broadcast), else every rank distributes it over the mesh (distribute_tensor: torch.chunk, no
# aten.split). Same world size or another, all three classes; torch.optim.AdamW loads both ways. File in pytorch/ao.
import torch, torch.distributed as dist, torch.nn as nn
import torchao.optim.adam as adam
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

adam.torch = type("EagerTorch", (), {"__getattr__": lambda self, k: getattr(torch, k),  # torchao's step eagerly
                                     "compile": staticmethod(lambda fn, **kw: fn)})()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def trained(cls):
    torch.manual_seed(0)
    model = nn.Linear(128, 64 * world, bias=False)  # each rank's shard 64 x 128: torchao quantizes it
    fully_shard(model, mesh=mesh)
    opt = cls(model.parameters(), lr=0.1)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    return model, opt


bad = 0
for cls in (AdamW8bit, AdamW4bit, AdamWFp8, torch.optim.AdamW):
    for broadcast in (False, True) if world == 1 else (False,):  # (over 2+ ranks rank 1 would wait in the broadcast)
        model, opt = trained(cls)
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))  # (every rank)
        held = type(full["state"]["weight"]["exp_avg"]).__name__
        fresh, fresh_opt = trained(cls)
        try:
            set_optimizer_state_dict(fresh, fresh_opt, full,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
            msg = "loaded"
        except NotImplementedError as e:
            bad, msg = 1, f"BUG REPRODUCED: NotImplementedError: {str(e).split('func=')[-1][:60]}"
        print(f"rank {rank}: {cls.__name__}, full state holds {held}, broadcast_from_rank0={broadcast}: {msg}")
dist.destroy_process_group()
raise SystemExit(bad)
