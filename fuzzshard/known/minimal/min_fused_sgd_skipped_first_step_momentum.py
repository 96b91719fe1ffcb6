# python min_fused_sgd_skipped_first_step_momentum.py
# Fused SGD with momentum: a first step that GradScaler skips (an inf in the grads) leaves every
# momentum_buffer as torch.empty_like(grad) (torch/optim/sgd.py _fused_sgd: is_first_step allocates them,
# then the kernel returns on found_inf without writing them); the next step is no longer a first step and
# reads that uninitialized memory as momentum. The for-loop SGD keeps no buffer after a skipped step.
import sys, torch
torch.set_num_threads(1)


def run(fused):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused, foreach=None if fused else False)
    scaler = torch.amp.GradScaler("cpu")
    for k in range(2):
        opt.zero_grad()
        loss = (p * p).sum() * (float("inf") if k == 0 else 1.0)  # step 0 overflows: it is skipped
        scaler.scale(loss).backward()
        if k == 0:
            junk = torch.full((4,), float("nan"))  # freed memory the buffer's empty_like may get
            del junk
        scaler.step(opt)
        scaler.update()
    return p.detach(), opt.state[p].get("momentum_buffer")


(a, ma), (b, mb) = run(False), run(True)
print("for-loop SGD:", a.tolist(), None if ma is None else ma.tolist())
print("fused SGD:   ", b.tolist(), None if mb is None else mb.tolist())
bad = not (torch.equal(a, b) and mb is not None and torch.equal(ma, mb))
print("BUG REPRODUCED: fused SGD's momentum after a skipped first step is not the for-loop's" if bad else "ok")
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
