"""Four shortcuts through LocalTensorMode for a simulated case, each giving
bit for bit what it replaces (docs/simulate.md, "Speed").

LocalTensorMode (torch.distributed._local_tensor) runs every op once per
simulated rank, and around each rank's run it saves and restores that rank's
RNG state (a 5 KB copy each way, plus an accelerator query) and rebuilds the
op's arguments through the generic pytree. At 64 ranks that, not the ops,
is most of a case. A simulated worker runs only simulated cases, so while
one runs (``installed()``) it takes four shortcuts:

  * **the rank loop**: an op that draws no random numbers (no
    ``nondeterministic_seeded`` tag; or one of DTensor's per-rank padding and
    shard-size helpers) runs on each rank's tensors without the
    RNG save/restore, which only a random op can notice, and its arguments
    are rebuilt per rank by a plain walk over the lists, tuples and dicts an
    aten op takes. Random ops, ``split`` and ``hash_tensor`` (special-cased
    by torch) keep torch's loop;
  * **sharding propagation's output metadata** (global shape, stride and
    dtype of an op's result, from the global metadata of its inputs) is the
    same on every rank, so it runs once with the mode off, as a real rank
    runs it, not once per simulated rank on fake tensors;
  * **splitting a tensor into shards** (``Shard._split_tensor``:
    distribute_tensor's scatter, reduce-scatter's padding) runs once per
    distinct tensor: every rank of a freshly distributed param holds the
    same bytes, so splitting them W times into W chunks (W² ops at 64 ranks)
    gives the same chunks as splitting one. Ranks holding the same bits share
    the chunks, which these callers only read (scatter, cat, index);
  * **an all-gather's or reduce-scatter's re-cat on another dim** (funcol's
    chunk-and-cat of the gathered tensor) runs on each rank's own tensor with
    the mode off: through the mode, W chunk views each re-entered it once per
    rank to fix their aliasing (W² entries, each copying W RNG states).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed._local_tensor as ltm  # a simulated worker's import only: torch >= 2.10 (simulated.available)
from torch._ops import OpOverload
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode, maybe_disable_local_tensor_mode
from torch.utils._python_dispatch import return_and_correct_aliasing

# DTensor's per-rank Python helpers (maybe_run_for_local_tensor: pad, unpad, shard sizes and offsets), which draw
# no random numbers either; any other Python function keeps torch's loop
RANDOM_FREE = ("torch.distributed.tensor.placement_types", "torch.distributed.tensor._collective_utils",
               "torch.distributed.tensor._utils")
SHARED_MAX = 8  # a split is done once per distinct tensor where at most this many differ (a 2x4 mesh's 8)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> an int dtype to compare bits


@contextlib.contextmanager
def installed():
    """The shortcuts, for the length of one simulated case (torch's own functions back afterwards);
    none with FUZZSHARD_SIMULATE_SHORTCUTS=0 in the environment (to rule them out)."""
    if os.environ.get("FUZZSHARD_SIMULATE_SHORTCUTS", "1") == "0":
        yield
        return
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.placement_types import Shard

    on = applicable()
    saved = (ltm._for_each_rank_run_func, ShardingPropagator._propagate_tensor_meta_non_cached,
             Shard.__dict__["_split_tensor_helper"], funcol._maybe_view_chunk_cat,
             funcol._chunk_or_narrow_cat) if len(on) == len(SHORTCUTS) else None
    if saved is None:  # a release whose private functions differ: torch's own path, whole (slower, never wrong)
        yield
        return
    ltm._for_each_rank_run_func = _rank_loop(saved[0])
    ShardingPropagator._propagate_tensor_meta_non_cached = _meta_once(saved[1])
    Shard._split_tensor_helper = staticmethod(_split_once(saved[2].__func__))
    funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = _each_rank(saved[3]), _each_rank(saved[4])
    try:
        yield
    finally:
        ltm._for_each_rank_run_func, ShardingPropagator._propagate_tensor_meta_non_cached = saved[:2]
        Shard._split_tensor_helper = saved[2]
        funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = saved[3:]


# what the shortcuts replace or call, with the parameters they rely on (the same in torch 2.13.0, 2.14.1 and
# 2.15.0): on a release where any is missing or differs, none is taken (installed() leaves torch's path as it
# is: slower, never wrong) and the worker's log says which, once
SHORTCUTS = {
    "torch.distributed._local_tensor._for_each_rank_run_func": ("func", "ranks", "args", "kwargs", "alias"),
    "torch.distributed._local_tensor._combine_rank_results": ("rank_results", "default"),
    "torch.distributed._local_tensor._is_inplace_op": ("op",),
    "torch.distributed._local_tensor._map_to_rank_local_val": ("val", "rank"),
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached":
        ("self", "op_schema"),
    "torch.distributed.tensor.placement_types.Shard._split_tensor_helper":
        ("tensor", "num_chunks", "with_padding", "contiguous", "dim"),
    "torch.distributed._functional_collectives._maybe_view_chunk_cat": ("res", "group_size", "gather_dim"),
    "torch.distributed._functional_collectives._chunk_or_narrow_cat": ("tensor", "num_chunks", "narrow_dim", "cat_dim"),
}
_applicable: list | None = None


def applicable() -> list:
    """The SHORTCUTS whose targets this torch has with the parameters named (once per process)."""
    global _applicable
    if _applicable is None:
        import importlib
        import inspect
        import sys

        _applicable, off = [], []
        for path, params in SHORTCUTS.items():
            parts, obj = path.split("."), None
            for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                for name in parts[i:]:
                    raw = getattr(obj, "__dict__", {}).get(name) if isinstance(obj, type) else None
                    obj = raw if raw is not None else getattr(obj, name, None)
                    if isinstance(obj, staticmethod):
                        obj = obj.__func__
                break
            try:
                ok = obj is not None and tuple(inspect.signature(obj).parameters) == params
            except (TypeError, ValueError):
                ok = False
            (_applicable if ok else off).append(path)
        if off:
            print(f"fuzzshard: simulate shortcuts off on torch {torch.__version__} (torch's own LocalTensorMode path "
                  f"instead): {', '.join(off)} not as fuzzshard knows it", file=sys.stderr)
    return _applicable


def _rank_loop(torch_loop):
    own_loop = (torch.ops.aten.split.Tensor, torch.ops.aten.hash_tensor.default)  # torch special-cases these
    seeded, inplace_view = torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view

    def loop(func, ranks, args, kwargs, *, alias: bool = True):
        if not (getattr(func, "__module__", None) in RANDOM_FREE if not isinstance(func, OpOverload) else
                seeded not in func.tags and func not in own_loop):
            return torch_loop(func, ranks, args, kwargs, alias=alias)
        a, k = _waited(args), _waited(kwargs)
        results = {r: func(*_on_rank(a, r), **_on_rank(k, r)) for r in sorted(ranks)}
        if ltm._is_inplace_op(func):  # as torch's loop: self, its size re-read after an in-place view op
            if inplace_view in func.tags:
                args[0]._sync_meta()
            return args[0]
        out = ltm._combine_rank_results(results, None)
        return return_and_correct_aliasing(func, args, kwargs, out) if alias else out

    return loop


def _on_rank(x, r: int):
    """``x`` with every LocalTensor (and per-rank int) replaced by rank ``r``'s."""
    if isinstance(x, LocalTensor):
        return x._local_tensors[r]
    kind = type(x)
    if kind is list or kind is tuple:
        return kind([_on_rank(v, r) for v in x])
    if kind is dict:
        return {key: _on_rank(v, r) for key, v in x.items()}
    return ltm._map_to_rank_local_val(x, r) if kind is torch.SymInt else x


def _waited(x):
    """``x`` with every AsyncCollectiveTensor waited for (torch's loop does it first)."""
    kind = type(x)
    if kind is list or kind is tuple:
        return kind([_waited(v) for v in x])
    if kind is dict:
        return {key: _waited(v) for key, v in x.items()}
    return x.wait() if isinstance(x, AsyncCollectiveTensor) else x


def _meta_once(propagate):
    def meta(self, op_schema):
        if _per_rank_int((op_schema.args_schema, op_schema.kwargs_schema)):  # a rank's own size: per rank, as torch
            return propagate(self, op_schema)
        with maybe_disable_local_tensor_mode():
            return propagate(self, op_schema)

    return meta


def _per_rank_int(x) -> bool:
    """Whether ``x`` holds an int that differs between simulated ranks (a LocalIntNode)."""
    if isinstance(x, (list, tuple)):
        return any(_per_rank_int(v) for v in x)
    if isinstance(x, dict):
        return any(_per_rank_int(v) for v in x.values())
    return isinstance(x, torch.SymInt) and isinstance(x.node, ltm.LocalIntNode)


def _each_rank(regroup):
    """``regroup(t, ...)`` run on each rank's own tensor with the mode off, the results one LocalTensor (as
    LocalTensor's own maybe_run_for_local_tensor helpers run), where ``t`` is a LocalTensor of one shape on
    every rank and the rest is the same on every rank: then each rank's chunks and cat are what the mode's
    ops give. (Of different shapes, the mode pads a rank's shorter list of chunks with empty ones, and its
    cat may raise where a real rank's does not: that stays as torch has it, a LocalTensor limitation.)"""
    def per_rank(t, *args, **kwargs):
        mode = enabled_local_tensor_mode()
        if mode is None or not isinstance(t, LocalTensor) or not all(type(s) is int for s in t._size) \
                or (t.requires_grad and torch.is_grad_enabled()) or _per_rank_int((args, kwargs)):
            return regroup(t, *args, **kwargs)
        with mode.disable():
            return LocalTensor({r: regroup(x, *args, **kwargs) for r, x in sorted(t._local_tensors.items())})

    return per_rank


def _split_once(split):
    def once(tensor, num_chunks, with_padding, contiguous, dim):
        mode = enabled_local_tensor_mode()
        # only where every rank's tensor has one shape (the pad sizes are then plain ints, the same on every
        # rank) and no autograd graph is recorded through the split
        groups = None
        if mode is not None and isinstance(tensor, LocalTensor) and all(type(s) is int for s in tensor._size) \
                and not (tensor.requires_grad and torch.is_grad_enabled()):
            with mode.disable():
                groups = _same_bits(tensor._local_tensors)
        if groups is None:  # nothing (or too little) to share
            return split(tensor, num_chunks, with_padding, contiguous, dim)
        with mode.disable():
            per_rank = {}
            for first, ranks in groups:
                chunks, pads = split(first, num_chunks, with_padding, contiguous, dim)
                per_rank.update((r, chunks) for r in ranks)
            return [LocalTensor({r: per_rank[r][i] for r in sorted(per_rank)}) for i in range(len(chunks))], pads

    return once


def _same_bits(tensors: dict) -> list | None:
    """[(a tensor, the ranks whose tensor has its dtype, strides and bits)], in rank order; None where
    more than SHARED_MAX differ (each rank's own sum, say: comparing them all would cost more than it saves)."""
    groups: list = []
    for r in sorted(tensors):
        t = tensors[r]
        for first, ranks in groups:
            if first is t or _bit_equal(first, t):
                ranks.append(r)
                break
        else:
            if len(groups) == min(SHARED_MAX, len(tensors) - 1):
                return None
            groups.append((t, [r]))
    return groups


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = _BITS.get(a.element_size())
    if bits is None or a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    return torch.equal(a.view(bits), b.view(bits))
