"""torchao's low-bit AdamW (``torchao.optim``: AdamW8bit, AdamW4bit, AdamWFp8) on fsdp2's DTensor params (--ao).

torchao keeps Adam's two moments block-wise quantized: a param's state is viewed as blocks of ``block_size``
elements (256; 128 for 4 bits), each stored as codes plus one float32 scale, the block's amax (8 and 4 bits: the
code is the nearest entry of a lookup table over [-1, 1], the dynamic-exponent map for a signed moment, its
unsigned twin for the second; float8: e4m3 of the value over amax / 448). Under FSDP2 it quantizes each rank's
local shard (``_AdamBase._new_buffer``: the shard, flattened, in blocks), and only where that shard has at least
4096 elements and a whole number of blocks: elsewhere the state stays float32. The step reads the moments back
to float32, updates them and the param from the float32 values, and quantizes the new moments.

The reference (``lowbit_class(name, reference=True)``): the same torchao class, its state never quantized
(``_new_buffer`` a float32 zero tensor). fuzzshard's anchored reference loads the sharded run's state as it
reads it (dequantized, ``lowbit_plain``) before each step, so both sides step from the same float32 moments and
grads: the params agree to the step's rounding (torchao updates the param from the float32 moments), and each
moment differs by the sharded side's quantization of it only. That error is bounded per element by the format
and the block the element is in on its rank (``lowbit_bound``): one interval of the code table at the element's
value over its block's amax, times that amax (rounding to the nearest code moves a value by at most half an
interval; the other half covers the ulps by which the sharded side's float32 value and amax may differ). A
scale taken from another block, or blocks laid across a shard boundary, moves elements by far more.

The draw widens the model (``lowbit_model``): appended Linear(d, R) and Linear(R, d) whose rows split over the
shard ranks into shards of at least 4096 elements in whole blocks (R a multiple of the ranks), or off by one row
(the last rank's shard then stays float32: a layout that mixes both). torchao compiles its per-param step
(``torch.compile(single_param_adam, fullgraph=True)``): on CPU that is a C++ build per param shape in every
process (a minute and more per case on 2 loaded cores), so fuzzshard runs the same step eagerly
(``lowbit_eager``: torchao's code and subclasses, without Inductor); compiled on DTensor, AdamW4bit and AdamWFp8
raise (torchao findings, known/). Names prefixed lowbit_ (the flattened kernel holds every module in one
namespace); torchao is imported inside the functions.
"""
from __future__ import annotations

import contextlib
import math

# torchao's classes and their default block sizes (torchao/optim/adam.py)
LOWBIT_OPTIMIZERS = {"AdamW8bit": 256, "AdamW4bit": 128, "AdamWFp8": 256}
LOWBIT_MIN = 4096  # torchao quantizes a local shard of at least this many elements (bitsandbytes' rule)
LOWBIT_KWARGS = ("lr", "betas", "eps", "weight_decay", "amsgrad")  # what torchao's constructors take
LOWBIT_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # quantized; "step" stays a float32 scalar


def lowbit_available() -> bool:
    """torchao importable (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def draw_lowbit(draw, optim, model, mesh_shape: tuple) -> tuple:
    """(optim, model): half the time (drawn first, off the simplest) the drawn optimizer becomes one of torchao's
    low-bit AdamWs with what it drew of lr, betas, eps, weight decay and amsgrad, and the model gains a wide pair of Linears
    (``lowbit_model``) whose shards get quantized state: evenly split, or a row short."""
    import dataclasses

    import hypothesis.strategies as st

    on = draw(st.booleans())
    if not on or model.factory or model.tie_head:
        return optim, model
    name = draw(st.sampled_from(sorted(LOWBIT_OPTIMIZERS)))
    short = draw(st.sampled_from([0, 0, 1]))  # the last rank's shard a row short: it keeps float32 state
    kwargs = {k: v for k, v in optim.kwargs.items() if k in LOWBIT_KWARGS}
    optim = dataclasses.replace(optim, name=name, kwargs=kwargs, tensor_lr="")
    return optim, lowbit_model(model, mesh_shape[-1], LOWBIT_OPTIMIZERS[name], short)


def lowbit_rows(d: int, shards: int, block: int) -> int:
    """Rows of a Linear(d, R) weight whose Shard(0) over ``shards`` ranks gives each rank R / shards rows of d
    elements: at least LOWBIT_MIN elements, a whole number of blocks."""
    unit = math.lcm(d, block)
    return shards * unit // d * math.ceil(LOWBIT_MIN / unit)


def lowbit_model(model, shards: int, block: int, short: int = 0):
    """``model`` with Linear(d, R), tanh, Linear(R, d) appended (d its output width), R = ``lowbit_rows``
    less ``short`` (over more than one shard: one shard a row short is no shard at all quantized)."""
    import dataclasses

    from ..case import Layer
    from .model import out_dim

    d = out_dim(model)
    rows = lowbit_rows(d, shards, block) - (short if shards > 1 else 0)
    wide = (Layer("linear", d, rows), Layer("act", act="tanh"), Layer("linear", rows, d))
    return dataclasses.replace(model, layers=tuple(model.layers) + wide)


def lowbit_problem(case, mesh: tuple, options: dict) -> str | None:
    """What a low-bit optimizer cannot be drawn with (fsdp2's check)."""
    if case.optim.name not in LOWBIT_OPTIMIZERS:
        return None
    if not lowbit_available():
        return f"{case.optim.name} needs torchao (pip install 'fuzzshard[ao]')"
    extra = sorted(set(case.optim.kwargs) - set(LOWBIT_KWARGS))
    if extra:
        return f"{case.optim.name} takes no {extra}"
    if case.optim.tensor_lr:
        return f"{case.optim.name} makes its own tensor lr"
    for other in ("tp", "compile_step"):
        if options.get(other):
            return f"{case.optim.name} with {other}: not drawn yet (its state's layout is fully_shard's dim-0 shards)"
    ck = case.checkpoint
    if ck and ck.async_save:
        # fuzzshard's own limit: its async-save check (kernel/state_io.py) clones the live state to see what the
        # save left alone, and OptimState8bit / OptimState4bit / OptimStateFp8 implement no aten.clone (met with
        # AdamW8bit by the --ao hunt as fsdp2.error.save.NotImplementedError.314ed209: fuzzshard's, not torchao's)
        return (f"{case.optim.name} with an async save: fuzzshard's staging check clones the live optimizer state, "
                "which its state subclass cannot (no aten.clone)")
    # amsgrad (root cause torchao-lowbit-amsgrad-maximum), float64 params (torchao-lowbit-float64-lerp), a full state
    # dict of a mixed layout (torchao-lowbit-full-state-dict-mixed) and a DCP load that cuts saved blocks
    # (torchao-lowbit-dcp-load-cuts-blocks) are drawn: known torchao bugs (fuzzshard/known/; lowbit_layout and
    # lowbit_cuts_blocks say where those two show); so is a full state dict of quantized state saved over more than
    # one rank, which keeps funcol's AsyncCollectiveTensors that the weights-only load refuses (torch >= 2.11:
    # torchao-lowbit-full-state-dict-async-wrapper)
    return None


def lowbit_chunks(rows: int, shards: int) -> list[tuple[int, int]]:
    """fully_shard's dim-0 shards: (start, end) rows of each rank (torch.chunk's sizes; empty past the end)."""
    per = -(-rows // shards) if rows else 0
    return [(min(i * per, rows), min((i + 1) * per, rows)) for i in range(shards)]


def lowbit_layout(shape: tuple, shards: int, block: int) -> list[bool]:
    """Whether torchao quantizes each rank's shard of a param of ``shape`` (_AdamBase._new_buffer's rule)."""
    if not shape:
        return [False] * shards
    stride = math.prod(shape[1:])
    sizes = [(e - s) * stride for s, e in lowbit_chunks(shape[0], shards)]
    return [n >= LOWBIT_MIN and n % block == 0 for n in sizes]


def lowbit_cuts_blocks(shape: tuple, saved: int, loading: int, block: int) -> bool:
    """Whether a loading rank's shard takes part of a saved quantized shard at a row that is not a block boundary
    of it (DCP narrows the saved OptimState to the overlap: its aten.slice wants block-aligned ends)."""
    if not shape:
        return False
    stride = math.prod(shape[1:])
    for (a, b), quantized in zip(lowbit_chunks(shape[0], saved), lowbit_layout(shape, saved, block)):
        for c, d in lowbit_chunks(shape[0], loading):
            lo, hi = max(a, c), min(b, d)
            if quantized and lo < hi and (((lo - a) * stride) % block or ((hi - a) * stride) % block):
                return True
    return False


@contextlib.contextmanager
def lowbit_eager():
    """torchao's step with ``torch.compile`` the identity inside torchao.optim.adam (its module global ``torch``
    swapped for a view of torch that passes every other name through)."""
    import torch
    import torchao.optim.adam as adam

    class LowbitTorch:
        def __getattr__(self, key):
            return getattr(torch, key)

        @staticmethod
        def compile(fn, **kwargs):
            return fn

    adam.torch = LowbitTorch()
    try:
        yield
    finally:
        adam.torch = torch


_CLASSES: dict = {}


def lowbit_class(name: str, reference: bool = False):
    """torchao's ``name`` stepping eagerly (``lowbit_eager``); ``reference``: its state never quantized."""
    key = (name, reference)
    if key not in _CLASSES:
        import torch
        import torchao.optim

        base = getattr(torchao.optim, name)

        def step(self, closure=None):
            with lowbit_eager():
                return base.step(self, closure)

        body = {"step": step, "__module__": __name__}
        if reference:
            body["_new_buffer"] = lambda self, p, signed: torch.zeros_like(p)
        _CLASSES[key] = type(f"{name}{'Reference' if reference else ''}", (base,), body)
    return _CLASSES[key]


def lowbit_plain(t):
    """A state tensor as plain float32 values: torchao's subclass dequantized (inside a DTensor: its local shard,
    rewrapped with the same layout); anything else as it is."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    if not type(local).__module__.startswith("torchao.optim"):
        return t
    plain = local.dequantize()
    if not isinstance(t, DTensor):
        return plain
    return DTensor.from_local(plain, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def lowbit_codebook(name: str, key: str):
    """The values a code stands for, over the block's amax (sorted, float64): the signed table for exp_avg, the
    unsigned one for the second moments; float8: every finite e4m3 value over its max (448)."""
    import torch

    if name == "AdamWFp8":
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
        return torch.unique(bits[bits.isfinite()]) / torch.finfo(torch.float8_e4m3fn).max
    from torchao.optim import subclass_4bit, subclass_8bit

    sub = subclass_4bit if name == "AdamW4bit" else subclass_8bit
    table = sub.get_qmap_signed() if key == "exp_avg" else sub.get_qmap_unsigned()
    return torch.tensor(sorted(table), dtype=torch.float64)


def lowbit_bound(name: str, key: str, x, shards: int):
    """Per element of the float32 moment ``x`` (the whole param's), how far the sharded side's quantized copy may
    be from it: in each rank's shard (dim-0 chunks, fully_shard's), where torchao quantizes it, one code
    interval at the element (its value over its block's amax) times the amax; 0 where the state stays float32."""
    import torch

    block = LOWBIT_OPTIMIZERS[name]
    out = torch.zeros(x.shape, dtype=torch.float64)
    if x.dim() == 0:
        return out
    codes = lowbit_codebook(name, key)
    start = 0
    for part in torch.chunk(x.detach().double(), shards, dim=0):
        rows = part.shape[0]
        if part.numel() >= LOWBIT_MIN and part.numel() % block == 0:
            v = part.reshape(-1, block)
            amax = v.abs().amax(-1, keepdim=True).clamp(min=1e-12)
            u = v / amax
            i = torch.searchsorted(codes, u.contiguous())
            lo = codes[(i - 1).clamp(min=0, max=len(codes) - 2)]  # (on the first code: its interval above)
            hi = codes[i.clamp(min=1, max=len(codes) - 1)]
            gap = torch.where(u < codes[0], 2 * (codes[0] - u), torch.where(u > codes[-1], 2 * (u - codes[-1]), hi - lo))
            out[start:start + rows] = (gap * amax).reshape(part.shape)
        start += rows
    return out


def lowbit_allowance(case, k: int, state: dict) -> dict:
    """{fqn: state name -> elementwise allowance or None} for the reference's state after step ``k`` (float32
    moments): ``lowbit_bound`` over the shards of the side that ran step k."""
    if case.optim.name not in LOWBIT_OPTIMIZERS:
        return {}
    mesh = case.checkpoint.mesh_shape if case.checkpoint and k > case.checkpoint.after else case.mesh_shape
    out = {}
    for fqn, st in state.items():
        bounds = {key: lowbit_bound(case.optim.name, key, v, mesh[-1]) for key, v in st.items() if key in LOWBIT_STATE}
        out[fqn] = lambda key, bounds=bounds: bounds.get(key)
    return out
