# torchrun --nproc-per-node 1 min_dsd_flatten_optim_empty_group.py
# get_/set_optimizer_state_dict with StateDictOptions(flatten_optimizer_state_dict=True), the form
# torchtitan's pipeline checkpoints use ("to support optimizer resharding for MPMD, e.g., pipeline
# parallelism"): an optimizer with an empty param group (torch.optim takes one) cannot be loaded.
# _flatten_optim_state_dict keys every hyperparameter by a param FQN ("param_groups.<fqn>.lr"), so an
# empty group's hyperparameters are not saved at all, and _unflatten_optim_state_dict reads each
# group's hyperparameters from its first param: pg_state[-1]["params"][0] -> IndexError on the empty
# group. The unflattened state dict (flatten_optimizer_state_dict=False) of the same optimizer loads.
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
dist.init_process_group("gloo")
torch.manual_seed(0)


def make():   # groups: [weight, bias], [] (empty: e.g. the params it names live on another pipeline stage)
    m = torch.nn.Linear(2, 2)
    return m, torch.optim.SGD([{"params": list(m.parameters())}, {"params": [], "lr": 0.5}], lr=0.1)


m, opt = make()
m(torch.randn(4, 2)).sum().backward(); opt.step()
for flatten in (False, True):
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    osd = get_optimizer_state_dict(m, opt, options=options)
    m2, opt2 = make()
    try:
        set_optimizer_state_dict(m2, opt2, osd, options=options)
        print(f"flatten_optimizer_state_dict={flatten}: loads; groups' lrs {[g['lr'] for g in opt2.param_groups]}")
    except IndexError as e:
        print(f"flatten_optimizer_state_dict={flatten}: IndexError: {e}  <- BUG "
              f"(saved keys: {sorted(k for k in osd if k.startswith('param_groups'))[:2]} ...)")
dist.destroy_process_group()
