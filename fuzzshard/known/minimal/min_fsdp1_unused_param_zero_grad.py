# torchrun --nproc-per-node 1 min_fsdp1_unused_param_zero_grad.py
# FSDP1 (use_orig_params=True): a param that the forward never uses but that shares a FlatParameter with used
# params gets a zero grad instead of None after backward (the post-backward resets its "grad is None" mask for
# every param with requires_grad), so torch.optim steps it: weight decay / momentum / Adam state move it.
import sys, warnings, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(2, 2)
        self.unused = torch.nn.Linear(2, 2)   # never called in forward
    def forward(self, x):
        return self.used(x)

torch.manual_seed(0)
ref = Net()
fsdp = FSDP(Net(), use_orig_params=True, device_id=torch.device("cpu"))   # one FlatParameter: used.*, unused.*
with FSDP.summon_full_params(fsdp):
    fsdp.load_state_dict(ref.state_dict())
opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.1)
opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, weight_decay=0.1)
x = torch.randn(4, 2)
for m, o in ((ref, opt_ref), (fsdp, opt)):
    o.zero_grad()
    m(x).sum().backward()
    o.step()
g_fsdp = fsdp.unused.weight.grad   # this rank's shard of it (None where the param is not in this rank's shard)
grads = [None] * dist.get_world_size()
dist.all_gather_object(grads, None if g_fsdp is None else g_fsdp.tolist())
with FSDP.summon_full_params(fsdp):
    diff = (fsdp.unused.weight - ref.unused.weight).abs().max().item()
bad = any(g is not None for g in grads) or diff > 1e-6   # same on every rank
if rank == 0:
    print("unused.weight.grad, plain          :", ref.unused.weight.grad)
    print("unused.weight.grad, FSDP1 per rank :", grads)
    print("unused.weight after SGD(weight_decay=0.1) step: max |FSDP1 - plain| = %.3g" % diff)
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
