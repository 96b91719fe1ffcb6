"""Capturable Adam/AdamW (single-tensor path, foreach=False) with lr=0 turns every param it steps
into NaN; the foreach path and the non-capturable one leave them alone. Torch alone, one GPU:
    python min_capturable_adam_lr0.py
The capturable single-tensor path folds the step size into the denominator,
    denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
with step_size_neg = -lr / bias_correction1, so lr == 0 divides by zero (0/0 and eps/0).
DSD's _init_optim_state steps a fresh optimizer with every lr set to 0 to make its state, so a
full-state-dict set_optimizer_state_dict into FSDP1 (or any model) with capturable AdamW leaves
NaN params (fuzzshard: fsdp1.checkpoint.{full,broadcast}.loaded.param on CUDA); so would an LR
schedule that starts at 0. Seen on torch 2.11.0+cu130, H100."""
import torch

for name in ("Adam", "AdamW"):
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.ones(3, device="cuda"))
        opt = getattr(torch.optim, name)([p], lr=0.0, capturable=True, foreach=foreach)
        p.grad = torch.zeros_like(p)
        opt.step()
        ref = torch.nn.Parameter(torch.ones(3, device="cuda"))
        plain = getattr(torch.optim, name)([ref], lr=0.0, foreach=foreach)
        ref.grad = torch.zeros_like(ref)
        plain.step()
        print(f"{name} foreach={foreach}: capturable {p.detach().tolist()} vs not capturable {ref.detach().tolist()}")
