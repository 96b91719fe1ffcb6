# torchrun --nproc-per-node 2 min_tp_colwise_rowwise_uneven_width.py
# ColwiseParallel -> RowwiseParallel over a width the TP degree does not divide (an MLP of hidden 3 on 2 ranks):
# the column-wise Linear hands on its local output (use_local_output=True, the default), and RowwiseParallel's
# _prepare_input_fn wraps that plain tensor with DTensor.from_local(..., run_check=False) and no shape, which
# assumes an even shard: rank 0 (2 columns) reads a global width of 4, rank 1 (1 column) of 2, neither 3, and
# the row-wise mm raises. distribute_tensor shards the weights unevenly without complaint.
import sys, torch, torch.distributed as dist, torch.nn as nn
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
hidden = world + 1   # not a multiple of the TP degree
mlp = nn.Sequential(nn.Linear(4, hidden, bias=False), nn.Linear(hidden, 4, bias=False))
x = torch.randn(2, 4)
want = mlp(x)
parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
try:
    got = mlp(x)
    bad, what = not torch.allclose(got, want, atol=1e-5), f"max |TP - plain| = {(got - want).abs().max().item():.3g}"
except RuntimeError as e:
    bad, what = True, f"raises RuntimeError: {str(e).splitlines()[0][:160]}"
if rank == 0:
    print(f"colwise -> rowwise over width {hidden} on {world} ranks:", what)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
