# torchrun --nproc-per-node 2 min_fsdp2_divide_factor_single_rank_shard.py
# FSDP2 with a gradient divide factor f on a shard group of one rank (a 1-rank mesh, or HSDP with shard size 1) divides
# the grads by f twice whenever _get_gradient_divide_factors splits f into a pre-/post-divide (sum-only comms, or a
# float16/float64 reduce dtype): foreach_reduce's single-rank branch copies reduce_scatter_input / f and the
# post-divide divides by f again. Silent: the grads are f times too small.
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
bad = 0
for shape, force, dtype in [((w, 1), True, torch.float32), ((w, 1), False, torch.float64), ((w,), True, torch.float32)]:
    torch.manual_seed(0)
    m = nn.Linear(3, 2).to(dtype)
    ref = nn.Linear(3, 2).to(dtype); ref.load_state_dict(m.state_dict())
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    fully_shard(m, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    m.set_gradient_divide_factor(4.0)
    if force:
        m.set_force_sum_reduction_for_comms(True)
    x = torch.randn(w, 3, generator=torch.Generator().manual_seed(1), dtype=dtype)
    m(x[r:r + 1]).sum().backward()
    ref(x).sum().backward()
    got, want = m.weight.grad.full_tensor(), ref.weight.grad / 4.0  # summed over the ranks, divided by the factor once
    ok = torch.allclose(got, want)
    bad += not ok
    if r == 0:
        print(f"mesh {shape} force_sum={force} {dtype}: {'ok' if ok else f'grads {float(want.flatten()[0] / got.flatten()[0]):g} x too small'}")
dist.destroy_process_group()
raise SystemExit(1 if bad else 0)
