"""State-dict I/O: save a sharded model and optimizer mid-schedule and load
them into a fresh pair, through torch's own APIs (``get_state_dict`` /
``set_state_dict``, ``torch.save`` of the full dict, ``dcp.save`` /
``dcp.load`` with the file-system writer and reader) into a real directory.
What must survive the round trip is checkpoint.py's (the oracles); a target
that saves its own way (fsdp1, zero, sharded_optim) overrides Target.save and
Target.load and may reuse these.

A DCP save may be ``dcp.async_save`` (``Checkpoint.async_save``, ``dcp_save``):
training goes on while it runs, so right after the call returns (after its
staging future, where it returns one: torchtitan's ``maybe_wait_for_staging``
before the next optimizer step) every tensor the saved state dict holds is
changed in place, as a step would, until the upload is done; then the values
are put back. What loads must be the state at the call (checkpoint.py's
*loaded* oracle): a copy taken after the call returned shows there.
"""
from __future__ import annotations

import atexit
import os
import threading

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
        dcp_save(case, {"model": msd, "optim": osd}, os.path.join(path, "dcp"), group)
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


# ---- async saves ----------------------------------------------------------

# Checkpoint.async_save -> how torch.distributed.checkpoint.async_save is called (in draw order; "" a blocking
# dcp.save): the forms torchtitan's async_mode runs, as far as the device allows
ASYNC_SAVES = {
    "thread": "async_save(checkpoint_id=...), the form of torchtitan's async_mode='async' and the recipe: torch "
              "makes its own DefaultStager (a blocking copy to CPU in the call) and uploads on a thread; a Future",
    "writer": "async_save(storage_writer=FileSystemWriter(...)): the writer stages for itself (BlockingAsyncStager, "
              "a blocking copy to CPU in the call), the upload on a thread; a Future",
    "stager": "async_save(async_stager=...) with a DefaultStager the process keeps and reuses (staging on its own "
              "thread): an AsyncSaveResponse, the state changed once its staging is complete",
    "pinned": "as stager, the DefaultStager staging into pinned, shared memory (torchtitan's "
              "async_mode='async_with_pinned_mem' on the thread executor, not its checkpoint process; pinning "
              "needs CUDA: torch ignores it on CPU, with a warning)",
}

# the DefaultStagers kept by this process, one per form and device type, reused by every case's save (as a
# training job keeps one over its saves, torchtitan's CheckpointManager.stager); closed at exit
_STAGERS: dict = {}


def async_save_problem(case: Case) -> str | None:
    """Why the case's async_save cannot run (a CaseError's text), None if it can or is unused."""
    ck = case.checkpoint
    how = ck.async_save if ck else ""
    if not how:
        return None
    if how not in ASYNC_SAVES:
        return f"checkpoint async_save {how!r}: one of {sorted(ASYNC_SAVES)} (or \"\", a blocking save)"
    if ck.kind != "dcp":
        return f"checkpoint async_save {how!r}: async_save is a DCP save, and a {ck.kind!r} checkpoint saves otherwise"
    missing = _missing_api(how)
    if missing:
        return f"checkpoint async_save {how!r}: this torch's torch.distributed.checkpoint has no {missing}"
    if case.device != "cpu":
        # async_save asserts a CPU backend in its process group; the pool's groups on CUDA are NCCL only (torchtitan
        # makes a gloo group for its async saves: a pool started with "cpu:gloo,cuda:nccl" would lift this)
        return (f"checkpoint async_save {how!r} on {case.device}: async_save needs a CPU backend in the process "
                f"group, and the pool's groups there are NCCL only")
    return None


def _missing_api(how: str) -> str:
    """What this torch lacks of what ``how`` calls ("" if nothing)."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "async_save"):
        return "async_save"
    if how in ("stager", "pinned"):
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError:
            return "DefaultStager"
        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            return "async_save(async_stager=...)"
    return ""


def dcp_save(case: Case, state_dict: dict, path: str, group) -> None:
    """``dcp.save`` of ``state_dict`` into ``path``, or ``dcp.async_save`` as the
    case's checkpoint says, training going on (the saved tensors changed in
    place) until the upload is done. Every future is waited for before this
    returns, on errors too: no save thread outlives the case."""
    import torch.distributed.checkpoint as dcp

    how = case.checkpoint.async_save if case.checkpoint else ""
    if not how:
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path), process_group=group)
        return
    stager = _stager(how, case.device) if how in ("stager", "pinned") else None
    try:
        if stager is not None:
            # an earlier save through the same stager, of other values (a loop saving every N steps): staging
            # the checkpoint's state must copy it again, not hand back what the stager holds from before
            with _changed(state_dict) as restore:
                response = dcp.async_save(state_dict, storage_writer=dcp.FileSystemWriter(path + "_earlier"),
                                          process_group=group, async_stager=stager)
                try:
                    _wait_staging(response)
                    restore()  # training goes on: the state of this save's call, restored while it uploads
                finally:
                    _wait_upload(response)  # (torchtitan waits for the last save before the next)
        if how == "thread":  # no writer: torch infers it from the path and stages with its own DefaultStager
            response = dcp.async_save(state_dict, checkpoint_id=path, process_group=group)
        else:
            response = dcp.async_save(state_dict, storage_writer=dcp.FileSystemWriter(path), process_group=group,
                                      **({"async_stager": stager} if stager is not None else {}))
        try:
            _wait_staging(response)
            with _changed(state_dict):  # training goes on while the save runs: the state changes in place
                _wait_upload(response)
        except BaseException:
            _wait_upload(response, quiet=True)
            raise
    except BaseException:
        if stager is not None:  # a stager a failed save went through is not reused: the next case starts anew
            _drop_stager(how, case.device)
        raise
    finally:
        _join_save_threads()


def _stager(how: str, device: str):
    """This process's DefaultStager for ``how`` on ``device``, made on first use."""
    key = (how, torch.device(device).type)
    if key not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # torchtitan's options for "pinned"; a non-blocking copy needs an accelerator (torch asserts one), and
        # without CUDA torch ignores the pinning, with a warning (once: the stager is kept)
        accelerator = key[1] != "cpu" and torch.accelerator.is_available()
        _STAGERS[key] = DefaultStager(StagingOptions(use_pinned_memory=how == "pinned",
                                                     use_shared_memory=how == "pinned", use_async_staging=True,
                                                     use_non_blocking_copy=accelerator))
    return _STAGERS[key]


def _drop_stager(how: str, device: str) -> None:
    stager = _STAGERS.pop((how, torch.device(device).type), None)
    if stager is not None:
        try:
            stager.close()
        except Exception:
            pass


@atexit.register
def close_stagers() -> None:
    """Close every kept stager (its staging thread, its cached copies)."""
    for key in list(_STAGERS):
        _drop_stager(*key)


def _wait_staging(response) -> None:
    """An AsyncSaveResponse's staging future (the state may change once it is done); a Future has none."""
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()


def _wait_upload(response, quiet: bool = False) -> None:
    upload = getattr(response, "upload_completion", response)
    try:
        upload.result()
    except BaseException:
        if not quiet:
            raise


def _join_save_threads(timeout: float = 30.0) -> None:
    """The upload executor's thread shuts itself down once its future is done: let it finish, so no
    save thread is alive when the case ends."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("AsyncCheckpointExecutor"):
            t.join(timeout)


class _changed:
    """Every tensor ``state_dict`` holds, changed in place on this rank (a
    float +1, a bool flipped: what a step does to params and state, here
    never zero), and put back on leaving or when ``restore()`` is called.
    A DTensor's or ShardedTensor's local storage is changed, never through a
    collective; a tensor held twice (tied) is changed once."""

    def __init__(self, state_dict: dict):
        self.live = _local_tensors(state_dict)
        self.before: list | None = None

    def __enter__(self):
        with torch.no_grad():
            self.before = [t.clone() for t in self.live]
            for t in self.live:
                if t.dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.add_(1)
        return self.restore

    def restore(self) -> None:
        if self.before is not None:
            with torch.no_grad():
                for t, b in zip(self.live, self.before):
                    t.copy_(b)
            self.before = None

    def __exit__(self, *exc) -> None:
        self.restore()


def _local_tensors(value, out: list | None = None, seen: set | None = None) -> list:
    """The local tensors (a DTensor's local tensor, a ShardedTensor's local shards) of every tensor in a nested
    state dict, each once, those with elements."""
    out, seen = ([] if out is None else out), (set() if seen is None else seen)
    if isinstance(value, dict):
        for v in value.values():
            _local_tensors(v, out, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _local_tensors(v, out, seen)
    elif isinstance(value, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            tensors = [value._local_tensor]
        elif hasattr(value, "local_shards"):  # a ShardedTensor
            tensors = [s.tensor for s in value.local_shards()]
        else:
            tensors = [value]
        for t in tensors:
            key = (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if t.numel() and key not in seen:
                seen.add(key)
                out.append(t)
    return out
