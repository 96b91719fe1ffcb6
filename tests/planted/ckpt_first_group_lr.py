"""Planted bug: loading an optimizer state dict applies the first param
group's lr to every group."""
import torch.distributed.checkpoint.state_dict as dsd

_orig = dsd._load_optim_state_dict


def _load_optim_state_dict(model, optimizers, state_dict, info):
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if groups:
        for g in groups[1:]:
            g["lr"] = groups[0]["lr"]
    return _orig(model, optimizers, state_dict, info)


dsd._load_optim_state_dict = _load_optim_state_dict
