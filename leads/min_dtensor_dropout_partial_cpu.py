"""nn.Dropout / F.dropout of a Partial DTensor raises on a CPU mesh (aten.bernoulli_.float in place on the
Partial empty_like that CPU's dropout decomposition makes); out of place ops redistribute a Partial input."""
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
print("relu ok:", F.relu(x).placements)
try:
    out = F.dropout(x, 0.5)
    print("dropout ok", out.placements)
except RuntimeError as e:
    print("dropout raises:", str(e).splitlines()[0])
out = F.dropout(x.redistribute(mesh, [Replicate()]), 0.5)
print("dropout of the same value, Replicate: ok", out.placements)
dist.destroy_process_group()
