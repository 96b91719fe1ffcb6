# torchrun --nproc-per-node 2 min_sharded_grad_scaler_fused_found_inf_sum.py
# FSDP's ShardedGradScaler with a fused optimizer on 2+ ranks applies a step it should skip (silent):
# ShardedGradScaler.unscale_ all-reduces found_inf with SUM (torch/distributed/fsdp/sharded_grad_scaler.py),
# so it holds the number of ranks that saw an inf (2.0 here, every rank overflowing); GradScaler.step hands
# it to the fused optimizer (_step_supports_amp_scaling), and the CPU fused kernels skip the update only when
# found_inf == 1.0. The params go non-finite while the scale backs off as for a skipped step.
# torch.amp.GradScaler's found_inf is 0 or 1; the non-fused path skips on any nonzero sum.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
dist.init_process_group("gloo"); rank = dist.get_rank()
results = {}
for fused in (False, True):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused, foreach=False)
    scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 4, process_group=dist.group.WORLD)
    scaler.scale((p * 2).sum() * float("inf")).backward()  # every rank overflows: the step must be skipped
    scaler.unscale_(opt)  # as a loop that clips does: found_inf all-reduced (SUM) -> 2.0
    scaler.step(opt)
    scaler.update()
    results[fused] = (p.detach().clone(), scaler.get_scale())
bad = not torch.equal(results[True][0], torch.ones(3)) and torch.equal(results[False][0], torch.ones(3))
if rank == 0:
    for fused, (p, s) in results.items():
        print(f"SGD(fused={fused}) after an overflow step: param {p.tolist()}, scale {s}")
    print("BUG REPRODUCED: the fused step was applied, not skipped" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
