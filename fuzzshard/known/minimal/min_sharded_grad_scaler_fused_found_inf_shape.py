# torchrun --nproc-per-node 1 min_sharded_grad_scaler_fused_found_inf_shape.py
# FSDP's ShardedGradScaler with a fused optimizer (Adam/AdamW/SGD/Adagrad fused=True) fails at its first step:
# ShardedGradScaler.unscale_ makes found_inf as torch.full((1,), ...) where GradScaler uses a 0-d tensor, and
# GradScaler.step (inherited) hands that 1-element found_inf to the fused optimizer, whose step decrements its
# 0-d 'step' state in place by it: torch._foreach_sub_(state_steps, [found_inf]) -> 'output with shape []
# doesn't match the broadcast shape [1]'. torch.amp.GradScaler with the same optimizer steps fine.
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
dist.init_process_group("gloo"); rank = dist.get_rank()
results = {}
for name, make in (("torch.amp.GradScaler", lambda: torch.amp.GradScaler("cpu", init_scale=1.0)),
                   ("ShardedGradScaler", lambda: ShardedGradScaler("cpu", init_scale=1.0))):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True)
    scaler = make()
    scaler.scale(lin(torch.randn(4, 3)).pow(2).mean()).backward()
    try:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        results[name] = "ok"
    except RuntimeError as e:
        results[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:150]}"
bad = results["ShardedGradScaler"] != "ok" and results["torch.amp.GradScaler"] == "ok"
if rank == 0:
    for name, r in results.items():
        print(f"{name} + AdamW(fused=True): {r}")
    print("BUG REPRODUCED" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
