# torchrun --nproc-per-node 2 min_dtensor_sdpa_cpu_no_strategy.py
# F.scaled_dot_product_attention on DTensors on CPU raises NotImplementedError: DTensor registers sharding
# strategies for the flash, efficient and cuDNN SDPA ops (CUDA) but not for the op the CPU dispatches to,
# aten._scaled_dot_product_flash_attention_for_cpu; heads-sharded (TP-style) q/k/v work on CUDA.
import sys, torch, torch.distributed as dist
import torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))   # [B, heads, L, head_dim]
want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
qd, kd, vd = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v))   # heads sharded, as TP does
try:
    got = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).full_tensor()
    bad, what = not torch.allclose(got, want, atol=1e-5), f"max |DTensor - plain| = {(got - want).abs().max().item():.3g}"
except NotImplementedError as e:
    bad, what = True, f"raises NotImplementedError: {str(e).splitlines()[0][:160]}"
if rank == 0:
    print("sdpa on heads-sharded DTensors:", what)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
