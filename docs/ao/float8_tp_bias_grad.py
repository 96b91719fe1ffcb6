"""torchao 0.18.0 + torch 2.13.0: under torchao's float8 TP styles a Linear's bias grad is computed from the output
grad rounded to float8 (e5m2), where the same float8 model unsharded computes it from the high-precision grad.

Float8ColwiseParallel / Float8RowwiseParallel._prepare_output_fn wrap the module's output (x @ W.T + b) in
NoopFwToFloat8BwDynamic, whose backward casts the incoming grad to e5m2 (2 mantissa bits) so that it is
redistributed in float8; the bias's grad (the sum of that grad over the batch) then reads the rounded values. Unsharded,
Float8Linear casts the output grad for its matmuls only and the bias grad stays in high precision. The weights'
grads agree (their matmuls take the e5m2 grad either way); the biases' differ by up to ~2^-3 of the grad (silent).
Bias-free Linears (torchtitan's LLaMA) do not show it. Tensorwise recipe, emulated on CPU, gloo:

    torchrun --nproc-per-node 2 float8_tp_bias_grad.py
"""
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
convert_to_float8_training(model, config=dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                                             emulate=True))
ref = copy.deepcopy(model)  # the same float8 model, unsharded
parallelize_module(model, mesh, {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()})
x = torch.randn(4, 16)
model(x).square().mean().backward()
ref(x).square().mean().backward()
for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
    got = model.get_parameter(name).grad.full_tensor()
    want = ref.get_parameter(name).grad
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"rank {dist.get_rank()}: grad {name}: max relative error {err:.2e}" + ("  <- e5m2 rounding" if err > 1e-5 else ""))
dist.destroy_process_group()
