# torchrun --nproc-per-node 1 min_zero_generator_param_group.py
# ZeroRedundancyOptimizer given a param group {"params": <generator>} (torch.optim accepts any iterable):
# _verify_and_init_params reads the generator (self._all_params.extend(...)), so Optimizer.__init__ gets the
# group with an exhausted generator: the group is empty, its params are silently never stepped.
import sys, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
zro = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
zro.load_state_dict(ref.state_dict())

def groups(m):  # group 0 as a list, group 1 as a generator
    return [{"params": [m[0].weight]}, {"params": (p for p in m[1].parameters()), "lr": 0.1}]

opt_ref = torch.optim.SGD(groups(ref), lr=0.1)
opt_zro = ZeroRedundancyOptimizer(groups(zro), optimizer_class=torch.optim.SGD, lr=0.1)
x = torch.randn(4, 2)
for m, o in ((ref, opt_ref), (zro, opt_zro)):
    m(x).sum().backward(); o.step()
n_ref = [len(g["params"]) for g in opt_ref.param_groups]
n_zro = [len(g["params"]) for g in opt_zro.param_groups]
diff = (ref[1].weight - zro[1].weight).abs().max().item()
bad = n_zro != n_ref or diff > 1e-6
if rank == 0:
    print("params per group, torch.optim.SGD          :", n_ref)
    print("params per group, ZeroRedundancyOptimizer  :", n_zro)
    print("layer 1 weight, SGD :", ref[1].weight.data.tolist())
    print("layer 1 weight, ZeRO:", zro[1].weight.data.tolist(), " (never stepped)" if diff > 1e-6 else "")
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
