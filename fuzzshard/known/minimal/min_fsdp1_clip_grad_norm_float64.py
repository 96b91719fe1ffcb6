# torchrun --nproc-per-node 2 min_fsdp1_clip_grad_norm_float64.py
# FullyShardedDataParallel.clip_grad_norm_ on a float64 model raises: _get_grad_norm
# (torch/distributed/fsdp/fully_sharded_data_parallel.py) calls
# torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32), which refuses to narrow a Double input
# ('the dtype of the input (Double) should be convertible without narrowing to the specified dtype (Float)').
# torch.nn.utils.clip_grad_norm_ on the same unsharded model works.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
ref = torch.nn.Linear(4, 2).double()
model = FSDP(torch.nn.Linear(4, 2).double(), device_id=torch.device("cpu"))
x = torch.randn(3, 4, dtype=torch.float64)
ref(x).sum().backward()
plain = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
model(x).sum().backward()
try:
    r = f"ok ({float(model.clip_grad_norm_(1.0)):.4f})"
except RuntimeError as e:
    r = f"raises RuntimeError: {str(e).splitlines()[0][:150]}"
bad = r.startswith("raises")
if rank == 0:
    print(f"torch.nn.utils.clip_grad_norm_: ok ({float(plain):.4f}); FSDP.clip_grad_norm_: {r}")
    print("BUG REPRODUCED" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
