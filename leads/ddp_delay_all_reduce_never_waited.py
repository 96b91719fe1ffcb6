"""DDP(delay_all_reduce_named_params=..., param_to_hook_all_reduce=...) on gloo: are the delayed grads averaged
when backward returns? The hook param is the first layer's weight (its grad is computed last), not delayed.

python leads/ddp_delay_all_reduce_never_waited.py big   # torch 2.13.0 CPU: some iterations' delayed grads unreduced
python leads/ddp_delay_all_reduce_never_waited.py       # a 4-wide model: 0 mismatches (the all-reduce wins the race)
python leads/ddp_delay_all_reduce_never_waited.py in    # the hook param delayed too: most grads wrong

DistributedDataParallel._delayed_all_reduce_hook (torch/nn/parallel/distributed.py) divides _delay_grad_buffer and
launches dist.all_reduce(..., async_op=True), discarding the Work: nothing waits for it before backward returns,
so on gloo (a CPU thread reducing in place) the grads the optimizer reads may be unreduced or half-reduced."""
import os, sys, torch, torch.distributed as dist, torch.nn as nn
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def run(rank, hook_in_delayed, big):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29551")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    d = 512 if big else 4
    m = nn.Sequential(nn.Linear(5, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 3))
    ref = nn.Sequential(nn.Linear(5, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 3)); ref.load_state_dict(m.state_dict())
    delayed = [(n, p) for n, p in m.named_parameters() if n.startswith(("2.", "4."))]
    if hook_in_delayed:
        delayed.append(("0.weight", m[0].weight))
    ddp = DDP(m, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=m[0].weight)
    bad = 0
    for k in range(30):
        torch.manual_seed(100 + k)
        x = torch.randn(4, 5)
        for p in m.parameters(): p.grad = None
        for p in ref.parameters(): p.grad = None
        ddp(x[2 * rank:2 * rank + 2]).sum().backward()
        got = {n: p.grad.clone() for n, p in m.named_parameters()}
        (ref(x).sum() / 2).backward()
        for n, p in ref.named_parameters():
            if not torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4):
                bad += 1
                if bad <= 3: print(f"rank {rank} iter {k} {n}: not the average (max diff {(got[n]-p.grad).abs().max():.3g})", flush=True)
    print(f"rank {rank}: {bad} mismatching grads over 30 iterations", flush=True)
    dist.barrier(); dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=("in" in sys.argv, "big" in sys.argv), nprocs=2)
