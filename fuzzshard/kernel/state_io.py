"""State-dict I/O: save a sharded model and optimizer mid-schedule and load
them into a fresh pair, through torch's own APIs (``get_state_dict`` /
``set_state_dict``, ``torch.save`` of the full dict, ``dcp.save`` /
``dcp.load`` with the file-system writer and reader) into a real directory.
What must survive the round trip is checkpoint.py's (the oracles); a target
that saves its own way (fsdp1, zero, sharded_optim) overrides Target.save and
Target.load and may reuse these.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..case import Case
from .model import plain_fqn

FULL_FILE = "full.pt"
# the round trips through torch.distributed.checkpoint's state-dict API (set_state_dict: split and strict
# apply), in draw order, each with how it saves and loads
STATE_DICT_KINDS = {"full": "full state dict, torch.save on rank 0, torch.load on every rank",
                    "dcp": "sharded state dict through torch.distributed.checkpoint",
                    "broadcast": "full state dict, read by rank 0, set_state_dict(broadcast_from_rank0=True)"}


def save(case: Case, model, opt, path: str, group) -> dict | None:
    """Collective over the saving job; rank 0 returns what it saved (full kinds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if case.checkpoint.kind == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(os.path.join(path, "dcp")),
                 process_group=group)
        return None
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    torch.save({"model": msd, "optim": osd}, os.path.join(path, FULL_FILE))
    return {"model": msd, "optim": osd}


def load(case: Case, model, opt, path: str, group) -> None:
    """Collective over the loading job: the checkpoint into a fresh model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict, set_state_dict)

    ck = case.checkpoint
    missing = keys_of(model, ck.missing)
    if ck.kind == "dcp":
        msd, osd = get_state_dict(model, opt)  # the sharded layout to load into
        # dcp.load fills the model's own tensors in place: a missing key is one it is not asked for
        sd = {"model": without(msd, missing), "optim": osd}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), process_group=group)
        msd, osd = sd["model"], sd["optim"]
        options = StateDictOptions(strict=ck.strict)
    else:
        broadcast = ck.kind == "broadcast"
        msd, osd = {}, {}
        if not broadcast or dist.get_rank() == 0:
            saved = torch.load(os.path.join(path, FULL_FILE))
            msd, osd = saved["model"], saved["optim"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=ck.strict)
    if msd:  # (not on a broadcast rank that holds nothing)
        msd = without(msd, missing)
        if ck.unexpected:
            msd[UNEXPECTED_KEY] = torch.zeros(2)
    if ck.split:
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
    else:
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


UNEXPECTED_KEY = "fuzzshard_unexpected.weight"


def keys_of(model, fqns) -> set[str]:
    """Every state-dict key of these params: a tied param has one per module
    holding it, and is missing only when all of them are."""
    if not fqns:
        return set()
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_fqn(n))
    return set(fqns) | {k for keys in names.values() if set(keys) & set(fqns) for k in keys}  # (flat params: by name)


def without(msd: dict, keys: set[str]) -> dict:
    """A copy of the state dict without ``keys`` (a copy: DSD rewrites the dict it loads)."""
    return {k: v for k, v in msd.items() if k not in keys}


def as_tensor(v):
    """A state value as a tensor (a step may be a Python number)."""
    return v if v is None or isinstance(v, torch.Tensor) else torch.tensor(v)
