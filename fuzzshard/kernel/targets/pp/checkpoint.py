"""pp's checkpoint: each rank saves and loads its own part through DCP.

Each stage's rank saves its own part of the model and its optimizer in one
DCP checkpoint; the loading side, at another pp degree (world size,
schedule, cuts), loads its own parts from the same directory. What may be
checkpointed (``check_checkpoint``) lives with the check, in draws.py.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ...state_io import UNEXPECTED_KEY, dcp_save, keys_of, without
from ....verdict import error_record


# how each kind saves and loads (Spec.checkpoint_kinds; kernel/state_io.py's STATE_DICT_KINDS name the same "dcp")
CHECKPOINT_KINDS = {
    "dcp": "torchtitan's pipeline checkpoint: each rank's model part (its stages' layers, the output scale on the last "
           "stage's rank) by get_model_state_dict and its optimizer by get_optimizer_state_dict("
           "flatten_optimizer_state_dict=True), plain FQN keys, dcp.save to one directory; dcp.load into the loading "
           "side's parts at another pp degree (world size, schedule, cuts), set_state_dict or the split setters",
}


class PipelineCheckpoint:
    """pp's save and load (``CHECKPOINT_KINDS``), mixed into ``PPTarget``: torchtitan's, each rank its own model
    part and optimizer by plain FQN. Reads the adapter's ``case`` and ``stages``."""

    def _part(self, model: nn.Module) -> nn.Module:
        """This rank's model part as it is saved and loaded: what the optimizer is over (its stages' layers, the
        decoder's ends, ``unused``) and, on the last stage's rank, the output ``scale`` buffer (a stage module's,
        the same tensor: a load fills it in place), all under their plain FQNs."""
        part = nn.Module()
        for name, child in model.named_children():
            part.add_module(name, child)
        for stage in self.stages:
            if hasattr(stage.submod, "scale"):
                part.register_buffer("scale", stage.submod.scale)
        return part

    def save(self, model: nn.Module, opt, path: str, group) -> dict | None:
        """Collective over the saving job: every rank's part and its flattened optimizer state dict (one key per
        param and state or hyperparameter, so each stage's keys are its own) in one DCP checkpoint."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        part = self._part(model)
        sd = {}

        def state_dicts():
            sd["model"] = get_model_state_dict(part)
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            sd["optim"] = get_optimizer_state_dict(part, opt, options=flat)

        self._together(state_dicts, group)  # (before dcp.save's collectives: no rank enters them alone)
        dcp_save(self.case, sd, os.path.join(path, "dcp"), group)
        return None

    def load(self, model: nn.Module, opt, path: str, group) -> None:
        """Collective over the loading job: the fresh part's and optimizer's own state dicts (the keys this rank
        holds at the loading side's pp degree) filled by ``dcp.load``, then set back, split or not, strict or
        not; a missing param is one this rank does not ask for. A rank whose own part of the load raises makes
        every rank raise (``_together``), as a job whose rank fails stops whole."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict, set_state_dict)

        ck = self.case.checkpoint
        part = self._part(model)
        sd = {}

        def state_dicts():  # the layout to load into
            sd["model"] = without(get_model_state_dict(part), keys_of(part, ck.missing))
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            sd["optim"] = get_optimizer_state_dict(part, opt, options=flat)

        def set_back():
            msd = dict(sd["model"])
            if ck.unexpected:
                msd[UNEXPECTED_KEY] = torch.zeros(2)
            options = StateDictOptions(strict=ck.strict, flatten_optimizer_state_dict=True)
            if ck.split:
                set_model_state_dict(part, msd, options=options)
                set_optimizer_state_dict(part, opt, sd["optim"], options=options)
            else:
                set_state_dict(part, opt, model_state_dict=msd, optim_state_dict=sd["optim"], options=options)

        self._together(state_dicts, group)  # (before dcp.load's collectives: no rank enters them alone)
        # DCP's collectives raise on every rank where one fails
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), process_group=group)
        self._together(set_back, group)

    def _together(self, fn, group) -> None:
        """``fn()`` on every rank of ``group``; where it raised on some, every rank raises a CheckpointException
        holding each failed rank's error (as DCP's own collectives raise: the lowest failed rank's error is the
        one a verdict reads, with that rank's traceback), so no rank waits in a collective for one whose load
        failed."""
        import traceback

        from torch.distributed.checkpoint.api import CheckpointException

        error = None
        try:
            fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException (it raises it on every rank)
            error = e
        failed = [None] * dist.get_world_size(group)
        said = None if error is None else error_record(error)  # (a CheckpointException's: its first failure's)
        dist.all_gather_object(failed, None if said is None else (said["type"], said["message"], said["traceback"]),
                               group=group)
        if all(f is None for f in failed):
            return
        me = dist.get_rank(group)
        failures = {}
        for r, f in enumerate(failed):
            if r == me and error is not None:
                failures[r] = (error, traceback.extract_tb(error.__traceback__))
            elif f is not None:  # another rank's error: its type, its message's first line (the signature's), and
                # below it that rank's traceback (where in torch it raised: the address a known root cause is met by)
                failures[r] = (type(f[0], (Exception,), {})(f"{f[1]}\n{f[2]}"), traceback.StackSummary())
        raise CheckpointException(f"pp checkpoint load failed on ranks {sorted(failures)}", failures) from error
