"""ReduceLROnPlateau reduces a tensor lr once per param group that shares it: one plateau takes
lr 1e-3 to 1e-5 with two groups, to 1e-6 with three, where a float lr (or one group) gives 1e-4.
Torch alone, one process, CPU:
    python min_reduce_lr_on_plateau_shared_tensor_lr.py
Optimizer(params, lr=torch.tensor(1e-3)) gives every param group without its own lr the SAME tensor
object (Optimizer.add_param_group: param_group.setdefault(name, default), no clone). Since the
tensor-lr fixes (pytorch/pytorch#163098) the schedulers write lrs in place
(lr_scheduler._update_param_group_val: param_group["lr"].fill_(new)), and ReduceLROnPlateau._reduce_lr
reads and writes group by group:
    old_lr = float(param_group["lr"]); new_lr = max(old_lr * factor, min_lr); fill_(new_lr)
so the second group reads the lr the first one just reduced and reduces it again (factor ** groups).
The other schedulers compute every group's lr first (get_lr) and then write each into the one tensor:
no compounding, but per-group lrs (LambdaLR with a lambda per group) all become the last group's.
So the lr a tensor-lr run trains with depends on how many param groups share it: under pipeline
parallelism each rank's optimizer holds only its stage's groups, and the ranks end up with different lrs
for the same group. Seen on torch 2.13.0 and 2.15.0 (CPU)."""
import torch

lrs = {}
for n_groups in (1, 2, 3):
    for tensor_lr in (False, True):
        params = [torch.nn.Parameter(torch.ones(1)) for _ in range(n_groups)]
        lr = torch.tensor(1e-3, dtype=torch.float64) if tensor_lr else 1e-3
        opt = torch.optim.SGD([{"params": [p]} for p in params], lr=lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0)
        sched.step(1.0)  # the best so far
        sched.step(2.0)  # no improvement, patience 0: one reduction, every group's lr * 0.1
        got = [float(g["lr"]) for g in opt.param_groups]
        lrs[n_groups, tensor_lr] = got
        print(f"{n_groups} group(s), {'tensor' if tensor_lr else 'float'} lr: lrs after one plateau {got}")
BAD = any(abs(v - 1e-4) > 1e-12 for got in lrs.values() for v in got)
# the same sharing, another face: LambdaLR with one lambda per group writes each group's lr into the one
# tensor, so the last group's lr wins for every group (expected [1.0, 0.5] after one step)
params = [torch.nn.Parameter(torch.ones(1)) for _ in range(2)]
opt = torch.optim.SGD([{"params": [p]} for p in params], lr=torch.tensor(1.0, dtype=torch.float64))
sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5 ** e])
opt.step()
sched.step()
lambda_lrs = [float(g["lr"]) for g in opt.param_groups]
print(f"LambdaLR, one lambda per group, tensor lr shared by 2 groups: lrs {lambda_lrs}, expected [1.0, 0.5]")
BAD |= lambda_lrs != [1.0, 0.5]
print("BUG REPRODUCED: param groups share one tensor lr, so a scheduler's per-group update leaks into the others"
      if BAD else "ok: each group's lr is its own")
raise SystemExit(1 if BAD else 0)  # exit 1: bug reproduced
