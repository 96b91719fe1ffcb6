# torchrun --nproc-per-node 2 min_fsdp1_scatter_optim_tensor_lr.py
# FSDP.scatter_full_optim_state_dict (any rank0_only optimizer-state load) sends the state dict to the
# other ranks through _broadcast_processed_state, which replaces every tensor with dims, 'param_groups'
# included, by a _PosDimTensorInfo placeholder; only the 'state' tensors are broadcast back. A 1-element
# tensor lr (torch.tensor([0.1]), which torch.optim accepts) thus reaches rank 1 as a placeholder and the
# for-loop step there raises TypeError. Seen on torch 2.13.0 and 2.15.0.
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
torch.set_num_threads(1); CPU = torch.device("cpu")
dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(4, 2)

def make():
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(2, 2), use_orig_params=False, device_id=CPU)
    return model, torch.optim.SGD(model.parameters(), lr=torch.tensor([0.1]), foreach=False)

src, opt = make()
opt.zero_grad(); src(x).sum().backward(); opt.step()
full = FSDP.full_optim_state_dict(src, opt)  # rank 0 only (rank0_only=True)

dst, opt2 = make()
osd = FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, dst)
opt2.load_state_dict(osd)
lr = opt2.param_groups[0]["lr"]
err = None
try:
    opt2.zero_grad(); dst(x).sum().backward(); opt2.step()
except TypeError as e:
    err = e
bad = torch.tensor([0 if isinstance(lr, torch.Tensor) and err is None else 1])
print(f"rank {rank}: loaded lr = {lr!r}; step: {err or 'ok'}", flush=True)
dist.all_reduce(bad)
if rank == 0:
    print("BUG REPRODUCED" if bad.item() else "ok")
dist.destroy_process_group()
sys.exit(1 if bad.item() else 0)   # exit 1: bug reproduced
