"""Planted bug: DSD's unflatten of a flattened optimizer state dict (get_/set_optimizer_state_dict with
flatten_optimizer_state_dict=True, the form torchtitan's pipeline checkpoints save and load each stage's
optimizer in, keyed by plain FQN so it reshards across pp degrees) reads a param's state under the FQN of
the next param of its group where both have state of the same shapes: the two params load each other's
state. Nothing raises (the shapes match); only the pp target loads flattened optimizer state dicts."""
import torch
import torch.distributed.checkpoint.state_dict as dsd

_orig = dsd._unflatten_optim_state_dict


def _shapes(state: dict) -> dict:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _unflatten_optim_state_dict(optim, state_dict, info):
    osd = _orig(optim, state_dict, info)
    state = osd["state"]
    for group in osd["param_groups"]:
        fqns = [f for f in group["params"] if state.get(f)]
        for a, b in zip(fqns, fqns[1:]):
            if _shapes(state[a]) == _shapes(state[b]):
                state[a], state[b] = state[b], state[a]
                return osd
    return osd


dsd._unflatten_optim_state_dict = _unflatten_optim_state_dict
