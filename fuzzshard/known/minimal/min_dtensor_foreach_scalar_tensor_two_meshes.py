# torchrun --nproc-per-node 4 min_dtensor_foreach_scalar_tensor_two_meshes.py   (gloo, CPU)
# foreach ASGD on a model whose params live on two meshes (one Linear FSDP2-only on the 1-D dp mesh,
# one Linear TP (Colwise) + FSDP2 on the 2-D mesh) fails on its first step: ASGD's foreach
# _foreach_addcmul_(params, intermediate, etas) passes plain 0-d eta/mu tensors, and DTensor's dispatcher
# replicates every plain tensor arg on ONE compute mesh (the first DTensor arg's), so the 2-D elements
# meet a 0-d 'Replicate' on the 1-D mesh. set_optimizer_state_dict hits it in _init_optim_state's step().
import sys, warnings; warnings.filterwarnings("ignore")
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
def make(tp_second=True, foreach=True):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if tp_second:  # else control: no TP, every param on the 1-D dp mesh
        parallelize_module(m[1], mesh["tp"], ColwiseParallel())
    fully_shard(m[0], mesh=mesh["dp"]); fully_shard(m[1], mesh=mesh["dp"]); fully_shard(m, mesh=mesh["dp"])
    return m, torch.optim.ASGD(m.parameters(), lr=1e-3, foreach=foreach)
def run(label, fn):
    try:
        fn(); msg = "ok"
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e)[:160]}"
    if rank == 0: print(f"{label}: {msg}", flush=True)
    return msg == "ok"
def plain_step(**kw):
    def f():
        m, o = make(**kw); m(torch.randn(2, 4)).sum().backward(); o.step()
    return f
# full optimizer state dict from an unsharded model's ASGD (one step taken: step=1, eta, mu, ax)
ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)); ro = torch.optim.ASGD(ref.parameters(), lr=1e-3, foreach=True)
ref(torch.randn(2, 4)).sum().backward(); ro.step()
full = get_optimizer_state_dict(ref, ro, options=StateDictOptions(full_state_dict=True))
def load():
    m, o = make(); set_optimizer_state_dict(m, o, full, options=StateDictOptions(full_state_dict=True))
ok = [run("plain foreach ASGD step, TP+FSDP2 mixed meshes", plain_step()),
      run("set_optimizer_state_dict(full) into the same model", load),
      run("control: foreach=False, mixed meshes", plain_step(foreach=False)),
      run("control: foreach=True, FSDP2 only (one mesh)", plain_step(tp_second=False))]
bad = ok == [False, False, True, True]
if rank == 0: print("BUG REPRODUCED" if bad else f"unexpected {ok}", flush=True)
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
