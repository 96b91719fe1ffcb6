# torchrun --nproc-per-node 1 min_torchao_lowbit_float64_lerp.py
# torchao's AdamW8bit on a float64 FSDP2 param large enough to be quantized (>= 4096 elements): the step's
# exp_avg.float().lerp(grad_f32, ...) over a DTensor whose local tensor is OptimState8bit keeps the float64 spec
# while the dequantized values are float32, and lerp refuses the mix (RuntimeError, sharding propagation).
# File in pytorch/ao (torchao states no dtype limit for its low-bit AdamW).
import torch, torch.distributed as dist, torch.nn as nn
import torchao.optim.adam as adam
from torch.distributed.fsdp import fully_shard
from torchao.optim import AdamW8bit
# torchao's step eagerly (compiled, a C++ build per param shape on CPU): torch.compile the identity in its module
adam.torch = type("EagerTorch", (), {"__getattr__": lambda self, k: getattr(torch, k),
                                     "compile": staticmethod(lambda fn, **kw: fn)})()
dist.init_process_group("gloo")
torch.manual_seed(0)
m = nn.Linear(128, 64, bias=False).double()  # 8192 elements: torchao keeps its state quantized
fully_shard(m)
opt = AdamW8bit(m.parameters(), lr=0.1)
m(torch.randn(4, 128, dtype=torch.float64)).sum().backward()
try:
    opt.step()
    bad, msg = 0, "stepped"
except RuntimeError as e:
    bad, msg = 1, f"BUG REPRODUCED: {str(e).splitlines()[0][:150]}"
print(f"AdamW8bit on a float64 FSDP2 param: {msg}")
dist.destroy_process_group()
raise SystemExit(bad)
