"""Planted bug: FSDP.optim_state_dict swaps two state tensors (exp_avg and
exp_avg_sq) of the first param, by FQN, that has both: one flat param's
state comes back mixed up while the optimizer itself is untouched."""
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

_orig = FSDP.optim_state_dict


def optim_state_dict(*args, **kwargs):
    osd = _orig(*args, **kwargs)
    for fqn in sorted(osd["state"]):
        st = osd["state"][fqn]
        if "exp_avg" in st and "exp_avg_sq" in st:
            st["exp_avg"], st["exp_avg_sq"] = st["exp_avg_sq"], st["exp_avg"]
            break
    return osd


FSDP.optim_state_dict = staticmethod(optim_state_dict)
