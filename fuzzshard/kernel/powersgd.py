"""PowerSGD's state round-tripped by a checkpoint (kernel/targets/ddp.py, a ``hook`` drawn with ``resume``).

``PowerSGDState`` holds what the hook carries from one iteration to the next: ``iter`` (PowerSGD starts at
``start_powerSGD_iter``), each bucket's local error (``error_dict``: error feedback, rank-local) and its P and
Q (``p_memory_dict``, ``q_memory_dict``: warm start), and the numpy ``rng`` that draws Q's seed. As a user
checkpoints it, each rank pickles its state (``torch.save(state)``: ``__getstate__`` drops the process
group) beside the model's checkpoint; the resumed run ``torch.load``s it into the state its hook is
registered with (``__setstate__`` sets the default group; the run sets its own, as torch's warning says).

Two checks, every rank's mismatches gathered (the error is rank-local):
  - *loaded*: right after the load the state equals the saving side's, field by field, exactly
    (quantity ``loaded.powersgd.<field>``);
  - *resumed*: the resumed training equals the uninterrupted one. The saving side's live state (that run
    stops with the save) goes on as the uninterrupted run's: every bucket the resumed run's hook reduces is
    reduced again from a copy of its input with that state, and the two results must be bit for bit the
    same (quantity ``resumed.powersgd.grad``, per param). Both reductions run to completion in turn, the
    same on every rank, so their collectives pair. Bucket indices key the state: the case keeps DDP's
    first bucket assignment on both sides (find_unused_parameters without static_graph: no rebuild).
In every PowerSGD case (kernel/targets/ddp.py) the hook waits for each bucket's reduction before it
returns: powerSGD_hook launches its P and Q all-reduces from future callbacks, which gloo runs on its worker
thread while the backward launches the next bucket's all-reduce, so with two buckets or more the ranks'
collectives may pair in another order (gloo's "Received data size doesn't match expected size", or a hang;
root cause ddp-powersgd-gloo-callback-collective-order, known/minimal/min_ddp_powersgd_gloo_callback_race.py);
a wait per bucket keeps one order on every rank, and the math is powerSGD_hook's.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from ..verdict import Mismatch
from .oracles import compare

POWERSGD_FILE = "powersgd_rank{}.pt"
STATE_FIELDS = ("iter", "error_dict", "p_memory_dict", "q_memory_dict", "rng")
_POWERSGD_EXACT = {"k_ulps": 0, "u": 0.0, "why": "a checkpointed state, and the same reduction of the same input: exact"}
# rank -> the saving side's live PowerSGDState: the uninterrupted run's state (same process: same world size)
_UNINTERRUPTED: dict = {}


def resumable(case) -> bool:
    """Whether PowerSGD's state may round-trip the case's checkpoint (kernel/powersgd.py): a loading side on
    the same ranks (the error is rank-local), a DDP wrapper on both."""
    ck = case.checkpoint
    return (ck is not None and ck.world_size == case.world_size and tuple(ck.mesh_shape) == tuple(case.mesh_shape)
            and not case.target_options.get("replicate"))


def resume_sides(out: dict, loading: dict) -> None:
    """PowerSGD's state round-tripped: both sides keep DDP's first bucket assignment (bucket indices key the
    state: find_unused_parameters without static_graph never rebuilds the buckets), and the loading side
    wraps as the saving side does (its own ``plain`` kept), the hook with it. In place."""
    ddp = {k: v for k, v in out.get("ddp", {}).items() if k != "static_graph"}
    out["ddp"] = {**ddp, "find_unused_parameters": True}
    plain = loading.get("plain")
    loading.clear()
    loading.update({k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                    for k, v in out.items() if k != "uneven"})
    if plain:
        loading["plain"] = True


def resume_ok(case) -> bool:
    """The saving side and the loading side as ``resume_sides`` makes them."""
    ck = case.checkpoint
    if not resumable(case) or case.target_options["hook"].get("name") != "powersgd":
        return False
    mine = {k: v for k, v in case.target_options.items() if k != "plain"}
    theirs = {k: v for k, v in ck.target_options.items() if k != "plain"}
    ddp = mine.get("ddp", {})
    return mine == theirs and ddp.get("find_unused_parameters") and not ddp.get("static_graph")


def powersgd_state(hook: dict, group):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    return ps.PowerSGDState(process_group=group, matrix_approximation_rank=hook["rank"],
                            start_powerSGD_iter=hook["start"], min_compression_rate=hook["min_rate"],
                            use_error_feedback=hook["feedback"], warm_start=hook["warm"])


def save_powersgd(state, path: str, group) -> None:
    """Each rank's state beside the checkpoint (pickled: ``__getstate__``)."""
    rank = dist.get_rank(group)
    torch.save(state, os.path.join(path, POWERSGD_FILE.format(rank)))
    _UNINTERRUPTED[rank] = state


def load_powersgd(path: str, group, step: int) -> tuple:
    """(the loaded state, the uninterrupted one, the loaded check's mismatches) on this rank."""
    rank = dist.get_rank(group)
    state = torch.load(os.path.join(path, POWERSGD_FILE.format(rank)), weights_only=False)
    state.process_group = group  # __setstate__ set the default group
    live = _UNINTERRUPTED.pop(rank, None)
    return state, live, [] if live is None else state_mismatches(state, live, step, rank)


def state_mismatches(got, want, step: int, rank: int) -> list[dict]:
    out = []
    for field in STATE_FIELDS:
        g, w = getattr(got, field, None), getattr(want, field, None)
        where = f"rank {rank}"
        if field == "rng":
            same = g is not None and all(np.array_equal(a, b) for a, b in zip(g.get_state(), w.get_state()))
            if not same:
                out.append(Mismatch("loaded.powersgd.rng", where, step, "the rng's state differs").to_dict())
        elif field == "iter":
            if g != w:
                out.append(Mismatch("loaded.powersgd.iter", where, step, f"{g!r} loaded, {w!r} saved").to_dict())
        else:
            g, w = g or {}, w or {}
            for i in sorted(set(g) | set(w)):
                m = compare(f"loaded.powersgd.{field}", step, f"bucket {i} on {where}", g.get(i), w.get(i),
                            _POWERSGD_EXACT)
                if m:
                    out.append(m)
    return out


class _BucketCopy:
    """What powerSGD_hook reads of a GradBucket, over a copy of its buffer (its gradients: views of the
    copy at the bucket's own offsets)."""

    def __init__(self, bucket):
        base = bucket.buffer()
        self._buffer = base.detach().clone()
        self._index, self._last = bucket.index(), bucket.is_last()
        self._grads = [self._buffer[g.storage_offset() - base.storage_offset():][:g.numel()].view(g.shape)
                       for g in bucket.gradients()]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def gradients(self):
        return self._grads


def resumed_hook(uninterrupted, names: dict, step_of, found: list):
    """powerSGD_hook with the loaded state, each bucket reduced again with the uninterrupted state from a
    copy of its input; the first param whose results differ goes into ``found``. ``names``: id(param) ->
    FQN; ``step_of()``: the schedule step this backward belongs to."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    def hook(state, bucket):
        copy = _BucketCopy(bucket) if uninterrupted is not None else None
        got = powerSGD_hook(state, bucket).wait()
        if copy is not None:
            powerSGD_hook(uninterrupted, copy).wait()
            if not found:
                for p, g, w in zip(bucket.parameters(), bucket.gradients(), copy.gradients()):
                    m = compare("resumed.powersgd.grad", step_of(), names.get(id(p), "?"), g, w, _POWERSGD_EXACT)
                    if m:
                        m["detail"] += f" (bucket {bucket.index()}: the resumed run's vs the uninterrupted one's)"
                        found.append(m)
                        break
        fut = torch.futures.Future()
        fut.set_result(got)
        return fut

    return hook


def gathered_mismatches(mine: list, group) -> list[dict]:
    """Every rank's mismatches (rank order), on every rank."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [m for ms in every for m in ms]
