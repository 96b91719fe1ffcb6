# torchrun --nproc-per-node 1 min_torchao_lowbit_amsgrad_maximum.py
# torchao's low-bit AdamW (AdamW8bit, AdamW4bit, AdamWFp8) with amsgrad=True, which their constructors take: on a
# param large enough to be quantized (>= 4096 elements) the first step raises. single_param_adam computes
# torch.maximum(max_exp_avg_sq.float(), exp_avg_sq_f32), and .float() of a float32-typed OptimState is the
# OptimState itself (no copy, so no dequantize): its dispatch implements no aten.maximum (NotImplementedError
# eagerly; torch.compile'd, as torchao runs it by default, dynamo's Unsupported over the same error). No FSDP, no
# process group needed (under FSDP2 the same error comes through DTensor). File in pytorch/ao (torchao 0.18.0).
import sys

import torch, torch.nn as nn
import torchao.optim.adam as adam
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

if "--compiled" not in sys.argv:  # torchao's step eagerly (compiled, a C++ build per param shape on CPU)
    adam.torch = type("EagerTorch", (), {"__getattr__": lambda self, k: getattr(torch, k),
                                         "compile": staticmethod(lambda fn, **kw: fn)})()
bad = 0
for cls in (AdamW8bit, AdamW4bit, AdamWFp8):
    torch.manual_seed(0)
    m = nn.Linear(128, 64, bias=False)  # 8192 elements: torchao keeps its state quantized
    opt = cls(m.parameters(), lr=0.1, amsgrad=True)
    m(torch.randn(4, 128)).sum().backward()
    try:
        opt.step()
        msg = "stepped"
    except Exception as e:  # NotImplementedError eagerly, torch._dynamo.exc.Unsupported compiled
        bad, msg = 1, f"BUG REPRODUCED: {type(e).__name__}: {str(e).splitlines()[0][:110]}"
    print(f"{cls.__name__}(amsgrad=True): {msg}")
raise SystemExit(bad)
