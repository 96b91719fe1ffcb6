"""Planted bug: a DCP load that reshards (the checkpoint was written by a
different number of ranks) swaps exp_avg and exp_avg_sq of one param."""
import glob
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_orig = dcp.load


def load(state_dict, *args, storage_reader=None, process_group=None, **kwargs):
    out = _orig(state_dict, *args, storage_reader=storage_reader, process_group=process_group, **kwargs)
    writers = len(glob.glob(os.path.join(str(storage_reader.path), "__*_0.distcp")))
    if writers != dist.get_world_size(process_group):
        for st in state_dict.get("optim", {}).get("state", {}).values():
            if "exp_avg" in st and "exp_avg_sq" in st:
                with torch.no_grad():
                    a = st["exp_avg"].clone()
                    st["exp_avg"].copy_(st["exp_avg_sq"])
                    st["exp_avg_sq"].copy_(a)
                break  # one param only
    return out


dcp.load = load
