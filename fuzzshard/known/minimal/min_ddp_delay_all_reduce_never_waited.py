# python min_ddp_delay_all_reduce_never_waited.py [small|in]
# DDP(delay_all_reduce_named_params=..., param_to_hook_all_reduce=...) on gloo: are the delayed params' grads the
# ranks' average when backward returns? DistributedDataParallel._delayed_all_reduce_hook (a tensor hook on
# param_to_hook_all_reduce's grad, torch/nn/parallel/distributed.py) divides _delay_grad_buffer by the world size
# and launches dist.all_reduce(..., async_op=True), discarding the Work: nothing waits for it (no final callback,
# no Reducer), so on gloo (a worker thread reducing in place) backward can return, and the optimizer read the
# grads, before the all-reduce has written them: some iterations' delayed grads are this rank's own (divided by
# the world size) or half-reduced. Here the hook param is the first layer's weight (its grad comes last), the
# later 512-wide layers delayed: a few (param, iteration) grads of 30 iterations per rank mismatch (a race: the
# rate varies with load; 0-10 per rank on torch 2.13.0 CPU). `small` (4-wide layers) showed 0 on a quiet machine
# and 19 per rank under load; `in` (the hook param delayed too: its grad accumulates into the buffer while the
# all-reduce reads it) gets most grads wrong.
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def run(rank, hook_in_delayed, d, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29551")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 3))
    m, ref = make(), make()
    ref.load_state_dict(m.state_dict())
    delayed = [(n, p) for n, p in m.named_parameters() if n.startswith(("2.", "4."))]
    if hook_in_delayed:
        delayed.append(("0.weight", m[0].weight))
    ddp = DDP(m, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=m[0].weight)
    bad = 0
    for k in range(30):
        torch.manual_seed(100 + k)
        x = torch.randn(4, 5)
        for p in [*m.parameters(), *ref.parameters()]:
            p.grad = None
        ddp(x[2 * rank:2 * rank + 2]).sum().backward()
        got = {n: p.grad.clone() for n, p in m.named_parameters()}  # what an optimizer step would read now
        (ref(x).sum() / 2).backward()  # the average of the two ranks' grads
        for n, p in ref.named_parameters():
            if not torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4):
                bad += 1
                if bad <= 2:
                    print(f"rank {rank} iter {k} {n}: not the average (max diff {(got[n] - p.grad).abs().max():.3g})",
                          flush=True)
    out.put((rank, bad))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=("in" in sys.argv, 4 if "small" in sys.argv else 512, out), nprocs=2)
    bad = dict(out.get() for _ in range(2))
    print(f"mismatching (param, iteration) grads over 30 iterations, per rank: {bad}")
    if any(bad.values()):
        print("BUG REPRODUCED: grads read after backward are not the delayed all-reduce's result")
        sys.exit(1)
    print("ok")
