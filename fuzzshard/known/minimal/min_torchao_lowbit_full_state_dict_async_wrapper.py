# torchrun --nproc-per-node 2 min_torchao_lowbit_full_state_dict_async_wrapper.py
# torchao 0.18.0 on torch >= 2.11: DTensor.full_tensor's all-gather ends in funcol's _maybe_wrap_tensor, now the
# custom op _c10d_functional._wrap_tensor_autograd, which OptimState4bit/8bit/Fp8 implement like wait_tensor: on
# codes and scale apart, so the gathered state is an OptimState whose codes and scale are AsyncCollectiveTensors.
# DSD's _gather_state_dict waits only an outer AsyncCollectiveTensor, and cpu_offload's .to("cpu") of a CPU tensor
# keeps it: the full state dict pickles the class and the default (weights_only) torch.load refuses the file. Every
# rank's shard is quantized (not torchao-lowbit-full-state-dict-mixed); the inner all-gathers are never waited.
import io, re

import torch, torch.distributed as dist, torch.nn as nn
import torchao.optim.adam as adam
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

adam.torch = type("EagerTorch", (), {"__getattr__": lambda self, k: getattr(torch, k),
                                     "compile": staticmethod(lambda fn, **kw: fn)})()  # torchao's step eagerly
dist.init_process_group("gloo")
rank, mesh, bad = dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),)), 0
for cls in (AdamW4bit, AdamW8bit, AdamWFp8):
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)  # 32 rows of 128 per rank: 4096 elements, quantized on both ranks
    fully_shard(model, mesh=mesh)
    opt = cls(model.parameters(), lr=0.1)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # (cpu_offload: the full state dict on rank 0 only)
        state, buf = osd["state"]["weight"]["exp_avg"], io.BytesIO()
        torch.save(osd, buf)
        try:
            torch.load(io.BytesIO(buf.getvalue()))
            msg = "weights-only load ok"
        except Exception as e:  # pickle.UnpicklingError
            bad, msg = 1, "BUG REPRODUCED: " + " ".join(re.findall(r"Unsupported global: \S+ \S+", str(e))[:1])
        print(f"{cls.__name__}: exp_avg {type(state).__name__}, codes {type(getattr(state, 'codes', state)).__name__}: "
              f"{msg}", flush=True)
dist.destroy_process_group()
raise SystemExit(bad)
