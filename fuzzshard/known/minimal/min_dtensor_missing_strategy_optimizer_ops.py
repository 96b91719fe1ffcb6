# torchrun --nproc-per-node 1 min_dtensor_missing_strategy_optimizer_ops.py
# DTensor has no sharding strategy for some ops the torch.optim steps call, so those optimizers fail on any DTensor
# param, even a Replicate one on a 1-rank mesh: 2.13.0 lacks aten._foreach_copy_ (foreach Rprop), aten._fused_sgd_
# (fused SGD) and aten._fused_adagrad_ (fused Adagrad): "Operator aten.X does not have a sharding strategy
# registered". 2.9.1 also lacks aten._foreach_lerp_.ScalarList (foreach Adafactor), and there an op without a
# strategy has no RuntimeSchemaInfo(needs_pytree) either: unwrap_to_op_info walks its Python lists unflattened and
# asserts "found no DeviceMesh from dtensor args for aten.X!" first (all four, on 2.9.1).
import sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
steps = {"Rprop foreach": lambda ps: torch.optim.Rprop(ps, foreach=True),
         "SGD fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
         "Adagrad fused": lambda ps: torch.optim.Adagrad(ps, fused=True),
         "Adafactor foreach": lambda ps: torch.optim.Adafactor(ps, foreach=True)}
failed = []
for name, make in steps.items():
    torch.manual_seed(0)
    p = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    p.grad = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    try:
        make([p]).step()
        what = "ok"
    except (NotImplementedError, AssertionError, RuntimeError) as e:
        what = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
        failed.append(name)
    if rank == 0:
        print(f"{name}: {what}")
if rank == 0:
    print("BUG REPRODUCED" if failed else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if failed else 0)   # exit 1: bug reproduced
