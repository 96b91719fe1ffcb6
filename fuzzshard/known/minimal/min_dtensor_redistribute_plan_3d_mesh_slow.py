"""One F.linear on a 2x2x2 mesh, tensors of a few dozen elements, spends tens of seconds
(47 s on a 2-core machine) choosing how to redistribute its input: DTensor's redistribute
planner searches shard orders over the 3 mesh dims. The same call with a replicated input
takes about 0.1 s. Torch alone, one process (the fake process group: the planning is the
same on every rank, and 8 real gloo ranks were all still inside it after 600 s):
    python min_dtensor_redistribute_plan_3d_mesh_slow.py
fuzzshard: dtensor.hang.fwdbwd.* (a Linear called twice, Twice(Linear(4, 8), SiLU, Linear(8, 4)),
weights [S0, S1, S0] and [R, S1, S1] on 2x2x2), found under --simulate; torch 2.13.0."""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (2, 2, 2))
w = distribute_tensor(torch.randn(4, 8), mesh, [Replicate(), Shard(1), Shard(1)])
x = torch.randn(2, 3, 8)
seconds = {}
for name, placements in (("replicated input", [Replicate()] * 3), ("input [S1, S0, S2]", [Shard(1), Shard(0), Shard(2)])):
    h = distribute_tensor(x, mesh, placements)
    t = time.perf_counter()
    F.linear(h, w)
    seconds[name] = time.perf_counter() - t
    print(f"F.linear, {name}: {seconds[name]:.2f} s", flush=True)
slow = seconds["input [S1, S0, S2]"]
if slow > 10 and slow > 20 * seconds["replicated input"]:
    print(f"BUG: {slow:.0f} s to plan one redistribute of a (2, 3, 8) tensor on a 2x2x2 mesh")
    raise SystemExit(1)
