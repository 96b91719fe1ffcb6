"""Planted bug: the optimizer state dict drops the state of params that are
frozen at save time (state they got from steps before they were frozen)."""
import torch.distributed.checkpoint.state_dict as dsd

_orig = dsd._get_optim_state_dict


def _get_optim_state_dict(model, optimizers, info):
    osd = _orig(model, optimizers, info)
    for fqn, p in model.named_parameters():
        if not p.requires_grad:
            osd.get("state", {}).pop(fqn, None)  # a full dict lives on rank 0 only
    return osd


dsd._get_optim_state_dict = _get_optim_state_dict
