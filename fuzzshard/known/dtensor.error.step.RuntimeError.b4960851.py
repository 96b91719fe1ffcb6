#!/usr/bin/env python
"""fuzzshard repro: error parity: only the sharded run raises, in step 0: optimizer.step: RuntimeError: The size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 0

Run:   torchrun --nproc-per-node 2 THIS_FILE.py
Found with torch 2.13.0+cpu, backend gloo. Needs only torch.
Exit code 0: no divergence now; 1: the divergence reproduces (printed below).
The code below is fuzzshard's own kernel, flattened: it builds the model from
CASE, trains it sharded, then replays an unsharded reference anchored on the
sharded state before every step and compares (see the oracles section).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

# ---- fuzzshard.case --------------------------------------------------------
"""The Case: one fuzzed training setup as frozen, JSON-round-trippable data.

Nothing but a Case crosses a process boundary. Everything a run needs to be
rebuilt bit for bit is in it, seeds included (Hypothesis does not seed torch).
Free-form values (optimizer kwargs, target options) hold JSON-native types
only (lists, not tuples), so ``Case.from_json(c.to_json()) == c`` always.
"""

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Layer:
    """One node of the model tree.

    kinds with params: linear, embedding, layernorm, conv1d;
    activations: act (``act`` names it); composites: seq, residual (x + f(x)),
    twice (f(f(x)), one submodule called twice in a forward).
    """

    kind: str
    d_in: int = 0
    d_out: int = 0
    bias: bool = True
    act: str = ""
    kernel: int = 1
    children: tuple[Layer, ...] = ()


@dataclass(frozen=True)
class Model:
    input: str  # "features" (float [B, L, d_in]) or "tokens" (int [B, L], d_in = vocab)
    d_in: int
    layers: tuple[Layer, ...]
    tie_head: bool = False  # tokens only: output projection reuses the embedding weight
    unused: bool = False  # a submodule whose params never get a grad
    buffer: bool = False  # a registered buffer scales the output


@dataclass(frozen=True)
class Optim:
    name: str  # a torch.optim class name
    kwargs: dict[str, Any] = field(default_factory=dict)
    tensor_lr: str = ""  # "", "0d" (lr as a 0-d tensor) or "1d" (1-element tensor)
    named: bool = False  # pass (name, param) pairs, the named-params API


@dataclass(frozen=True)
class Group:
    params: tuple[str, ...]  # parameter FQNs, in the order handed to the optimizer
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    set_to_none: bool = True  # zero_grad(set_to_none=...) before this step
    freeze: tuple[str, ...] = ()  # requires_grad_(False) before this step
    unfreeze: tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    target: str
    world_size: int
    mesh_shape: tuple[int, ...]
    model: Model
    optim: Optim
    groups: tuple[Group, ...]
    schedule: tuple[Step, ...]
    frozen: tuple[str, ...] = ()
    batch: int = 2
    seq: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    target_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **_to_jsonable(self)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Case:
        data = dict(data)
        fmt = data.pop("format", FORMAT_VERSION)
        if fmt != FORMAT_VERSION:
            raise CaseError(f"case format {fmt} is not supported (this fuzzshard reads {FORMAT_VERSION})")
        return _from_jsonable(cls, data, "case")

    @classmethod
    def from_json(cls, text: str) -> Case:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CaseError(f"not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise CaseError("a case must be a JSON object")
        return cls.from_dict(data)


def mesh_shapes(world: int) -> list[tuple[int, ...]]:
    """Meshes a world size can take: 1-D, then each 2-D factorisation with both sides > 1."""
    return [(world,)] + [(a, world // a) for a in range(2, world) if world % a == 0]


class CaseError(ValueError):
    """A case that cannot be read: bad JSON, a missing field, a wrong type."""


def _to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    return value


def _from_jsonable(tp: Any, value: Any, where: str) -> Any:
    """Rebuild a value of type ``tp`` from JSON data, with a clear error path."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise CaseError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise CaseError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _from_jsonable(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CaseError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):
            raise CaseError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_from_jsonable(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise CaseError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp in (int, float, str, bool):
        ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise CaseError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return value


# ---- fuzzshard.kernel.model ------------------------------------------------
"""Build a model from a Case's ``Model`` spec, deterministically from a seed."""

import torch
import torch.nn as nn
import torch.nn.functional as F


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}


class Act(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ACTIVATIONS[self.name](x)


class Conv(nn.Module):
    """Conv1d over the sequence axis of a [B, L, D] activation."""

    def __init__(self, d_in: int, d_out: int, kernel: int, bias: bool):
        super().__init__()
        self.conv = nn.Conv1d(d_in, d_out, kernel, padding=kernel // 2, bias=bias)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Twice(nn.Module):
    """One submodule called twice in one forward: its params get two grad contributions."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(self.inner(x))


class Net(nn.Module):
    def __init__(self, spec: Model):
        super().__init__()
        self.layers = nn.ModuleList(_build(layer) for layer in spec.layers)
        d_last = out_dim(spec)
        if spec.tie_head:
            emb = self.layers[0]
            self.head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
            self.head.weight = emb.weight  # tied: one Parameter registered twice
        if spec.unused:
            self.unused = nn.Linear(2, 3)  # never called: its grads stay None
        if spec.buffer:
            self.register_buffer("scale", torch.rand(d_last) + 0.5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if hasattr(self, "head"):
            x = self.head(x)
        if hasattr(self, "scale"):
            x = x * self.scale
        return x


def _build(layer: Layer) -> nn.Module:
    k = layer.kind
    if k == "linear":
        return nn.Linear(layer.d_in, layer.d_out, bias=layer.bias)
    if k == "embedding":
        return nn.Embedding(layer.d_in, layer.d_out)
    if k == "layernorm":
        return nn.LayerNorm(layer.d_in, bias=layer.bias)
    if k == "conv1d":
        return Conv(layer.d_in, layer.d_out, layer.kernel, layer.bias)
    if k == "act":
        return Act(layer.act)
    if k == "seq":
        return nn.Sequential(*[_build(c) for c in layer.children])
    if k == "residual":
        return Residual(nn.Sequential(*[_build(c) for c in layer.children]))
    if k == "twice":
        return Twice(nn.Sequential(*[_build(c) for c in layer.children]))
    raise ValueError(f"unknown layer kind {k!r}")


def build_model(spec: Model, seed: int, device: str, dtype: torch.dtype) -> Net:
    """The same seed gives bitwise the same initial model on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = Net(spec)
    return net.to(device=device, dtype=dtype)


def out_dim(spec: Model) -> int:
    if spec.tie_head:
        return spec.d_in  # the head maps back to the vocabulary
    d = spec.d_in
    for layer in spec.layers:
        d = _out(layer, d)
    return d


def _out(layer: Layer, d: int) -> int:
    if layer.kind in ("linear", "embedding", "conv1d"):
        return layer.d_out
    if layer.kind == "seq":
        for c in layer.children:
            d = _out(c, d)
    return d


def param_shapes(spec: Model) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of every unique parameter, in ``named_parameters()`` order,
    without building anything (strategies draw groups and placements from it)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i, layer in enumerate(spec.layers):
        _shapes(layer, f"layers.{i}", shapes)
    if spec.unused:
        shapes["unused.weight"] = (3, 2)
        shapes["unused.bias"] = (3,)
    return shapes


def _shapes(layer: Layer, prefix: str, out: dict) -> None:
    k = layer.kind
    if k == "linear":
        out[f"{prefix}.weight"] = (layer.d_out, layer.d_in)
        if layer.bias:
            out[f"{prefix}.bias"] = (layer.d_out,)
    elif k == "embedding":
        out[f"{prefix}.weight"] = (layer.d_in, layer.d_out)
    elif k == "layernorm":
        out[f"{prefix}.weight"] = (layer.d_in,)
        if layer.bias:
            out[f"{prefix}.bias"] = (layer.d_in,)
    elif k == "conv1d":
        out[f"{prefix}.conv.weight"] = (layer.d_out, layer.d_in, layer.kernel)
        if layer.bias:
            out[f"{prefix}.conv.bias"] = (layer.d_out,)
    elif k == "seq":
        for j, c in enumerate(layer.children):
            _shapes(c, f"{prefix}.{j}", out)
    elif k in ("residual", "twice"):
        for j, c in enumerate(layer.children):
            _shapes(c, f"{prefix}.inner.{j}", out)


def make_batch(spec: Model, seed: int, step: int, batch: int, seq: int, device: str, dtype: torch.dtype):
    """Global (inputs, targets) of one step; every rank draws the same."""
    g = torch.Generator().manual_seed(seed * 1000 + step + 1)
    if spec.input == "tokens":
        x = torch.randint(0, spec.d_in, (batch, seq), generator=g)
    else:
        x = torch.randn(batch, seq, spec.d_in, generator=g).to(dtype)
    y = torch.randn(batch, seq, out_dim(spec), generator=g).to(dtype)
    return x.to(device), y.to(device)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


# ---- fuzzshard.kernel.optim ------------------------------------------------
"""Build the optimizer of a Case, and move its state in and out by param FQN."""

import torch


# kwargs torch documents as tuples; a Case stores them as JSON lists
_TUPLE_KWARGS = ("betas", "etas", "step_sizes", "eps", "ns_coefficients")


def optimizer_kwargs(kwargs: dict, tensor_lr: str, device) -> dict:
    out = {}
    for k, v in kwargs.items():
        if k in _TUPLE_KWARGS and isinstance(v, list):
            v = tuple(v)
        if k == "lr" and tensor_lr:
            # a tensor lr stays on the CPU unless the optimizer is capturable/fused on an accelerator
            v = torch.tensor(v) if tensor_lr == "0d" else torch.tensor([v])
        out[k] = v
    return out


def build_optimizer(model: torch.nn.Module, case: Case) -> torch.optim.Optimizer:
    """The optimizer over the Case's param groups, in the Case's order; frozen
    params stay in their groups (torch.optim skips params without a grad)."""
    params = dict(model.named_parameters())
    cls = getattr(torch.optim, case.optim.name)
    groups = []
    for g in case.groups:
        ps = [(n, params[n]) if case.optim.named else params[n] for n in g.params]
        groups.append({"params": ps, **optimizer_kwargs(g.overrides, case.optim.tensor_lr, case.device)})
    return cls(groups, **optimizer_kwargs(case.optim.kwargs, case.optim.tensor_lr, case.device))


def param_order(case: Case) -> list[str]:
    """FQNs in the index order torch.optim uses in ``state_dict()``."""
    return [n for g in case.groups for n in g.params]


def state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, full) -> dict[str, dict[str, torch.Tensor]]:
    """{fqn: {state name: full plain tensor}} for every param that has state.
    ``full`` turns a sharded tensor into a full local copy (a collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out[names[id(p)]] = {k: _full_value(v, full) for k, v in sorted(st.items())}
    return out


def _full_value(v, full):
    if isinstance(v, torch.Tensor):
        return full(v).detach().clone()
    return torch.tensor(v)  # python scalars some optimizers keep


def group_hparams(opt: torch.optim.Optimizer) -> list[dict]:
    """Every group's hyperparameters (params excluded), as comparable values."""
    out = []
    for group in opt.param_groups:
        h = {}
        for k, v in sorted(group.items()):
            if k in ("params", "param_names"):
                continue
            h[k] = v.detach().cpu().tolist() if isinstance(v, torch.Tensor) else v
        out.append(h)
    return out


def load_state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace ``opt``'s per-param state with copies of ``state`` (plain full
    tensors), dtypes kept: ``load_state_dict`` would cast float state such as
    NAdam's float32 ``mu_product`` to the param dtype and change the numerics."""
    params = dict(model.named_parameters())
    opt.state.clear()
    for n, st in state.items():
        p = params[n]
        opt.state[p] = {k: v.to(p.device).clone() for k, v in st.items()}


# ---- fuzzshard.kernel.oracles ----------------------------------------------
"""Oracles: pure comparisons of what the sharded run did against the reference.

Tolerances are derived, never tuned. ``u`` is the unit roundoff of the dtype.
- *step*: the reference optimizer step starts from exactly the sharded
  params, state and grads (the reference is re-anchored every step), so the
  only legitimate difference is elementwise rounding of the same formulas
  (vectorised vs scalar tails, fused multiply-add): ``STEP_ULPS * u``, times
  the reduction length for optimizers that reduce over a param (Adafactor).
- *reduction*: loss and grads come from the same params and data but a
  different reduction order (sharded matmuls, collectives). Summing n terms
  in any order errs by at most ``n * u * sum|terms|`` (Higham); n is the
  longest reduction in the model times its depth, counted for both runs.
  ``sum|terms|`` is not visible in a result that cancels (a bias feeding a
  LayerNorm has an analytic grad of 0), so the bound also carries the
  tensor's *measured sensitivity*: how far it moves when every param and
  input is nudged by one ulp. Rounding inside a run acts like such nudges.
- *Partial grads*: a grad left Partial (unreduced) is reduced again by each
  optimizer op that reads it, in its own order; where its partials cancel
  the step is legitimately undetermined. The step bound of such a param
  grows by ``4 * r * |update|`` per element (state: ``4 * r * |state|``),
  r being the relative reduction error ``(2(n-1)+1) u sum|partials| / |g|``.
An element fails when ``|got - want| > atol + rtol * |want|`` with
``rtol = k*u`` and ``atol = k*u*max|want| + k*sensitivity``.
"""

import math

import torch

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
STEP_ULPS = 16


def step_tolerance(dtype: str, reduce_len: int = 1) -> dict:
    k = STEP_ULPS * reduce_len
    return {"k_ulps": k, "u": UNIT_ROUNDOFF[dtype], "why": f"same inputs, elementwise rounding: {k} ulps of {dtype}"}


def reduction_tolerance(dtype: str, n: int) -> dict:
    k = 2 * n
    return {
        "k_ulps": k,
        "u": UNIT_ROUNDOFF[dtype],
        "why": f"reordered reductions of length <= {n} on both sides: 2*{n} ulps of {dtype}",
    }


def compare(quantity: str, step: int, fqn: str, got, want, tol: dict, sens: float = 0.0, extra=None) -> dict | None:
    """None when ``got`` matches ``want`` within ``tol``, else a mismatch record.
    ``atol = k*u*max|want| + k*sens``, ``sens`` being the measured change of
    this tensor under one-ulp nudges of every input (0 for the step oracle);
    ``extra`` is an elementwise allowance (a Partial grad's reduction error)."""
    if got is None or want is None:
        if got is None and want is None:
            return None
        return _mismatch(quantity, step, fqn, tol, detail=f"sharded has {_desc(got)}, reference has {_desc(want)}")
    if tuple(got.shape) != tuple(want.shape):
        return _mismatch(
            quantity, step, fqn, tol, detail=f"shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
        )
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.numel() == 0:
        return None
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return _mismatch(quantity, step, fqn, tol, detail="NaN in one run only")
    g, w = g.masked_fill(nan_g, 0), w.masked_fill(nan_w, 0)
    inf = torch.isinf(g) | torch.isinf(w)
    if inf.any() and not torch.equal(g[inf], w[inf]):
        return _mismatch(quantity, step, fqn, tol, detail="inf in one run only")
    g, w = g.masked_fill(inf, 0), w.masked_fill(inf, 0)
    k_u = tol["k_ulps"] * tol["u"]
    atol = k_u * w.abs().max().item() + tol["k_ulps"] * sens
    err = (g - w).abs()
    bound = atol + k_u * w.abs()
    if extra is not None:
        bound = bound + extra.detach().to("cpu", torch.float64).nan_to_num(posinf=float("inf"))
    bad = err > bound
    if not bad.any():
        return None
    flat = int(torch.argmax(torch.where(bad, err - bound, torch.zeros_like(err))).item())
    idx = list(torch.unravel_index(torch.tensor(flat), tuple(w.shape))) if w.dim() else []
    at = tuple(int(i) for i in idx)
    e, ref = err.reshape(-1)[flat].item(), w.reshape(-1)[flat].item()
    return _mismatch(
        quantity,
        step,
        fqn,
        tol,
        max_abs=err.max().item(),
        max_rel=(err / w.abs().clamp_min(1e-300)).max().item(),
        at=at,
        got=g.reshape(-1)[flat].item(),
        want=ref,
        allowed=atol + k_u * abs(ref),
        bad=int(bad.sum().item()),
        numel=w.numel(),
        detail=f"|{e:.3g}| > {atol + k_u * abs(ref):.3g} at {at}",
    )


def compare_hparams(step: int, got: list[dict], want: list[dict]) -> dict | None:
    """Param-group hyperparameters must be equal exactly (they are not computed)."""
    if len(got) != len(want):
        return _mismatch("param_groups", step, "", None, detail=f"{len(got)} groups vs {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        for key in sorted(set(g) | set(w)):
            if not _same(g.get(key), w.get(key)):
                return _mismatch(
                    f"param_groups.{key}", step, f"group {i}", None, detail=f"{g.get(key)!r} vs reference {w.get(key)!r}"
                )
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _desc(t) -> str:
    return "none" if t is None else f"a tensor of shape {tuple(t.shape)}"


def _mismatch(quantity, step, fqn, tol, **fields) -> dict:
    out = {"quantity": quantity, "step": step, "fqn": fqn}
    if tol is not None:
        out["tolerance"] = tol["why"]
    out.update(fields)
    return out


# ---- fuzzshard.kernel.localize ---------------------------------------------
"""Name the module behind a loss or grad divergence."""

import torch



class Trace:
    """Records each leaf module's output (forward order) and the grad of that
    output (backward order), as full tensors. Used only to name the first
    diverging module once a loss or grad divergence is known: it decides no
    verdict, so its tolerance cannot cause a false positive."""

    def __init__(self, model, full, full_grad):
        self.full, self.full_grad, self.fwd, self.bwd, self.handles = full, full_grad, [], [], []
        for name, mod in model.named_modules():
            if not list(mod.children()) and name:
                kind = type(mod).__name__
                kind = kind[4:] if kind.startswith("FSDP") else kind  # fully_shard renames the class
                self.handles.append(mod.register_forward_hook(self._hook(name, kind)))

    def _hook(self, name, kind):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                self.fwd.append((name, kind, self.full(out).detach().clone()))
                if out.requires_grad:
                    out.register_hook(lambda g: self.bwd.append((name, kind, self.full_grad(g).detach().clone())))

        return hook

    def take(self):
        out, self.fwd, self.bwd = {"fwd": self.fwd, "bwd": self.bwd}, [], []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def localize_divergence(got: dict, want: dict, tol: dict) -> dict | None:
    """The first module whose output diverges (forward order), else the first
    whose output grad diverges (backward order): the module that consumed it
    computed a wrong input grad."""
    for phase in ("fwd", "bwd"):
        for (name, kind, g), (wname, _, w) in zip(got[phase], want[phase]):
            if name != wname:
                break  # the call orders differ: cannot localise further
            m = compare("forward" if phase == "fwd" else "backward", -1, name, g, w, tol)
            if m:
                m["module"] = kind
                m["detail"] = f"{'output' if phase == 'fwd' else 'output grad'} of {name} ({kind}): {m['detail']}"
                return m
    return None


# ---- fuzzshard.kernel.reference --------------------------------------------
"""The anchored reference: replay the plain model step by step from the
sharded run's own state and compare (see run.py for the whole picture).

Before step k the reference loads the sharded params and optimizer state
after step k-1, so float noise never compounds; loss and grads are compared
with the reduction tolerance (plus measured sensitivity), and the optimizer
step, taken from the sharded grads, with the step tolerance.
"""

import traceback

import torch



MAX_REPORTED = 8


def step_tolerance_for(case: Case, numel: int) -> dict:
    """Adafactor reduces over a param (row/column means); Muon's Newton-Schulz
    runs in bfloat16 whatever the param dtype, one reduction per iteration."""
    if case.optim.name == "Adafactor":
        return step_tolerance(case.dtype, 4 * numel)
    if case.optim.name == "Muon":
        return step_tolerance("bfloat16", case.optim.kwargs.get("ns_steps", 5))
    return step_tolerance(case.dtype)


def torch_dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)


def _plain_setup(case: Case, device: str):
    model = build_model(case.model, case.seed, device, torch_dtype(case))
    for n in case.frozen:
        model.get_parameter(n).requires_grad_(False)
    return model, build_optimizer(model, case)


def _apply_flags(model, step) -> None:
    for n in step.freeze:
        model.get_parameter(n).requires_grad_(False)
    for n in step.unfreeze:
        model.get_parameter(n).requires_grad_(True)


def _plain_reference_error(case: Case, device: str) -> dict | None:
    """Run the plain reference schedule un-anchored; its exception, if any."""
    try:
        model, opt = _plain_setup(case, device)
        for k, step in enumerate(case.schedule):
            _apply_flags(model, step)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, torch_dtype(case))
            loss_fn(model(x), y).backward()
            opt.step()
    except Exception as e:
        return _exc(e)
    return None


def reduction_length(case: Case) -> int:
    """Longest chain of summed terms behind a loss or grad element (see oracles)."""
    dims, kernel, depth = [case.model.d_in], 1, 1

    def walk(layers, mult):
        nonlocal kernel, depth
        for layer in layers:
            dims.extend([layer.d_in, layer.d_out])
            kernel = max(kernel, layer.kernel)
            if layer.kind in ("linear", "embedding", "conv1d", "layernorm"):
                depth += mult
            walk(layer.children, mult * (2 if layer.kind == "twice" else 1))

    walk(case.model.layers, 1)
    return case.batch * case.seq * max(dims) * kernel * (depth + 1)


def check_parity(case: Case, obs: dict, device: str, localize: bool = False) -> dict:
    dtype = torch_dtype(case)
    try:
        model, opt = _plain_setup(case, device)
    except Exception as e:
        return {"status": "invalid", "reason": f"reference rejects the config: {_exc(e)['text']}"}
    red_tol = reduction_tolerance(case.dtype, reduction_length(case))
    numel = max([p.numel() for p in model.parameters()] or [1])
    step_tol = step_tolerance_for(case, numel)
    params = dict(model.named_parameters())
    mismatches = _compare_state(-1, obs["init_state"], state_by_fqn(opt, model, lambda t: t), step_tol)
    prev = {"params": obs["init"], "state": obs["init_state"], "grads": {n: None for n in params}}
    for k, step in enumerate(case.schedule):
        rec = obs["steps"][k]
        try:
            _anchor(model, opt, case, prev)
            _apply_flags(model, step)
            opt.zero_grad(set_to_none=step.set_to_none)
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            sens = _sensitivity(model, params, x, y)
            trace = Trace(model, lambda t: t, lambda t: t) if localize and rec["trace"] else None
            loss = loss_fn(model(x), y)
            loss.backward()
            here = [compare("loss", k, "", rec["loss"], loss.detach(), red_tol, sens=sens["loss"])]
            here += [compare("grad", k, n, rec["grads"][n], p.grad, red_tol, sens=sens.get(n, 0.0)) for n, p in params.items()]
            here = [m for m in here if m]
            if trace:  # name the module behind this step's divergence, if it has one
                culprit = localize_divergence(rec["trace"], trace.take(), red_tol) if here else None
                trace.remove()
                if culprit:
                    culprit["step"] = k
                    return _finding([m for m in mismatches if m] + [culprit] + here)
            mismatches += here
            with torch.no_grad():  # step from the sharded grads: isolates the optimizer
                for n, p in params.items():
                    g = rec["grads"][n]
                    p.grad = None if g is None else g.to(p.device).clone()
            opt.step()
        except Exception as e:
            ref_error = _plain_reference_error(case, device)
            if ref_error is not None:
                return {"status": "invalid", "reason": f"reference raises: {ref_error['text']}"}
            return _finding([m for m in mismatches if m] + [{"quantity": "reference replay", "step": k, "fqn": "", "detail": f"the reference could not replay the sharded state: {_exc(e)['text']}"}])
        rel = _grad_uncertainty(case, rec)
        for n, p in params.items():
            extra = None if n not in rel else PARTIAL_GRAD_READS * rel[n] * (p.detach() - prev["params"][n].to(p.device)).abs()
            mismatches.append(compare("param", k, n, rec["params"][n], p.detach(), step_tol, extra=extra))
        mismatches += _compare_state(k, rec["state"], state_by_fqn(opt, model, lambda t: t), step_tol, rel)
        mismatches.append(compare_hparams(k, rec["groups"], group_hparams(opt)))
        prev = rec
    mismatches = [m for m in mismatches if m]
    if mismatches:
        return _finding(mismatches)
    return {"status": "pass"}


SENSITIVITY_DRAWS = 4


def _sensitivity(model, params: dict, x, y) -> dict[str, float]:
    """How far one ulp moves each result: rerun forward/backward with every
    param and float input nudged by one ulp (random direction, fixed seed),
    and take the largest change per tensor. Rounding anywhere in a legitimate
    run acts like such nudges, so k times this bounds it even where a result
    cancels to ~0 (e.g. through a LayerNorm over a near-constant row)."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(1234)  # fixed: a replay measures the same bound

    def nudge(t):
        up = torch.rand(t.shape, generator=g) < 0.5
        return torch.nextafter(t, torch.where(up.to(t.device), torch.tensor(float("inf"), dtype=t.dtype, device=t.device),
                                              torch.tensor(float("-inf"), dtype=t.dtype, device=t.device)))

    def run(perturb: bool):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(nudge(saved[n]) if perturb else saved[n])
                p.grad = None
        xin = nudge(x) if perturb and x.is_floating_point() else x
        loss = loss_fn(model(xin), y)
        loss.backward()
        return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}

    la, ga = run(False)
    out = {"loss": 0.0}
    for _ in range(SENSITIVITY_DRAWS):  # one draw can read 0 by chance (a flat rounding step)
        lb, gb = run(True)
        out["loss"] = max(out["loss"], float((la - lb).abs().max()))
        for n in params:
            if ga[n] is not None and gb[n] is not None and ga[n].numel():
                out[n] = max(out.get(n, 0.0), float((ga[n] - gb[n]).abs().max()))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
            p.grad = grads_before[n]
    return out


def _compare_state(k: int, got_state: dict, want_state: dict, tol: dict, rel: dict | None = None) -> list:
    """Step -1 is the state right after the optimizer constructor."""
    out = []
    for n in sorted(set(want_state) | set(got_state)):
        got, want = got_state.get(n, {}), want_state.get(n, {})
        for key in sorted(set(got) | set(want)):
            w = want.get(key)
            extra = None
            if rel and n in rel and w is not None and w.shape == rel[n].shape:
                extra = PARTIAL_GRAD_READS * rel[n] * w.abs()
            out.append(compare(f"state.{key}", k, n, got.get(key), w, tol, extra=extra))
    return out


# An elementwise optimizer reads the grad at most twice in one formula (g / |g|
# in Adagrad's first step); each read may carry its own reduction error.


# An elementwise optimizer reads the grad at most twice in one formula (g / |g|
# in Adagrad's first step); each read may carry its own reduction error.
PARTIAL_GRAD_READS = 4


def _grad_uncertainty(case: Case, rec: dict) -> dict:
    """Per param whose grad was Partial: the relative error, per element, of any
    one reduction of it. Summing n partials in two orders differs by at most
    2(n-1) u sum|partials|, plus u|g| for the final rounding; where the partials
    cancel (|g| << sum|partials|) the step is legitimately undetermined."""
    u = UNIT_ROUNDOFF[case.dtype]
    out = {}
    for n, (abs_sum, parts) in rec.get("grad_spread", {}).items():
        g = rec["grads"][n]
        delta = (2 * (parts - 1) + 1) * u * abs_sum.to(g.device)
        out[n] = delta / g.abs().clamp_min(torch.finfo(g.dtype).tiny)
    return out


def _anchor(model, opt, case: Case, rec: dict) -> None:
    """Make the reference exactly the sharded run's state after the previous step."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec["params"][n])
            p.grad = None if rec["grads"][n] is None else torch.zeros_like(p)
    load_state_by_fqn(opt, model, rec["state"])


def _finding(mismatches: list[dict]) -> dict:
    return {
        "status": "finding",
        "oracle": "parity",
        "first": mismatches[0],
        "mismatches": mismatches[:MAX_REPORTED],
        "count": len(mismatches),
    }


def _exc(e: BaseException) -> dict:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {
        "type": type(e).__name__,
        "message": msg[:500],
        "text": f"{type(e).__name__}: {msg[:300]}",
        "traceback": "".join(traceback.format_exception(e))[-4000:],
    }


# ---- fuzzshard.kernel.targets.dtensor --------------------------------------
"""Target ``dtensor``: params as DTensors + a plain torch.optim optimizer.

Every param is replaced by ``distribute_tensor(p, mesh, placements)`` with the
placements the Case draws per param (Shard(d) / Replicate per mesh dim);
buffers and inputs are replicated, so the forward and backward run through
DTensor's sharding propagation and the optimizer steps on local shards.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor



def parse_placement(text: str):
    """"R" -> Replicate(), "S1" -> Shard(1)."""
    return Replicate() if text == "R" else Shard(int(text[1:]))


class DTensorTarget:
    name = "dtensor"

    def __init__(self, case: Case, mesh):
        self.case = case
        self.mesh = mesh

    def shard(self, model: nn.Module) -> nn.Module:
        placements = self.case.target_options.get("placements", {})
        canonical = {id(p): n for n, p in model.named_parameters()}
        done: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in done:  # a tied param is distributed once and shared again
                    spec = placements.get(canonical[id(p)], ["R"] * self.mesh.ndim)
                    dt = distribute_tensor(p.detach(), self.mesh, [parse_placement(s) for s in spec])
                    done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
                module.register_parameter(name, done[id(p)])
            for name, b in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, self._replicate(b))
        return model

    def _replicate(self, t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, self.mesh, [Replicate()] * self.mesh.ndim)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        """Every rank sees the whole global batch, replicated."""
        loss = loss_fn(model(self._replicate(x)), self._replicate(y))
        return loss, loss.full_tensor()

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def grad_spread(self, g: torch.Tensor):
        """(sum of |partials|, number of partials) for a grad that is Partial on
        some mesh dims, else None. The optimizer's ops may each reduce such a
        grad in their own order, not the order full_tensor() used."""
        if not isinstance(g, DTensor) or not any(pl.is_partial() for pl in g.placements):
            return None
        n = 1
        for dim, pl in enumerate(g.placements):
            if pl.is_partial():
                n *= g.device_mesh.size(dim)
        abs_partials = DTensor.from_local(g.to_local().abs(), g.device_mesh, g.placements, shape=g.shape,
                                          stride=g.stride(), run_check=False)
        return abs_partials.full_tensor(), n


# ---- fuzzshard.kernel.run --------------------------------------------------
"""Run one Case: the sharded training on every rank, then the reference check.

The sharded run records, after every step, the full (gathered) loss, grads,
params, optimizer state and param-group hyperparameters. The reporting rank
then replays the reference *anchored*: before step k it loads the sharded
run's params and state after step k-1, so float noise never compounds over
steps and every divergence is caught at the step that made it:
  - loss and grads of step k vs the reference forward/backward on the same
    params and data (reduction tolerance);
  - params, state and hyperparameters after step k vs the reference
    optimizer stepping from the same params, state *and grads* (step tolerance).
A verdict is a plain dict: status pass | invalid | finding.
"""

import time



def run_case(case: Case, mesh, target_cls, device: str, reporter: bool, timings: dict | None = None,
             localize: bool = False) -> dict | None:
    """Every rank of the case's mesh calls this; only the reporter returns a verdict
    unless the sharded run raised here (then this rank returns the error verdict)."""
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    try:
        _plain_setup(case, device)
    except Exception as e:  # the reference itself rejects the config
        return {"status": "invalid", "reason": f"reference rejects the config: {_exc(e)['text']}"}
    obs, error = _run_sharded(case, mesh, target_cls, device, keep=reporter, localize=localize)
    t1 = timings["sharded"] = time.perf_counter() - t0
    if error is not None:
        ref_error = _plain_reference_error(case, device)
        if ref_error is not None:
            return {"status": "invalid", "reason": f"reference raises too: {ref_error['text']}", "error": error}
        return {"status": "finding", "oracle": "error_parity", "error": error}
    if not reporter:
        return None
    verdict = check_parity(case, obs, device, localize=localize)
    timings["reference"] = time.perf_counter() - t0 - t1
    return verdict


def _run_sharded(case: Case, mesh, target_cls, device: str, keep: bool, localize: bool = False):
    """(observations, None) or (None, error record). Collectives need every rank
    to gather in the same order, so all ranks gather and only ``keep`` stores."""
    dtype = torch_dtype(case)
    phase = "shard"
    try:
        target = target_cls(case, mesh)
        model = build_model(case.model, case.seed, device, dtype)
        init = {n: p.detach().clone() for n, p in model.named_parameters()} if keep else None
        model = target.shard(model)
        trace = Trace(model, getattr(target, "full_activation", target.full),
                      getattr(target, "full_activation_grad", target.full)) if localize else None
        for n in case.frozen:
            model.get_parameter(n).requires_grad_(False)
        phase = "optimizer constructor"
        opt = build_optimizer(model, case)
        phase = "gather initial optimizer state"
        init_state = state_by_fqn(opt, model, target.full)  # some optimizers fill state in __init__
        steps = []
        for k, step in enumerate(case.schedule):
            _apply_flags(model, step)
            phase = f"step {k}: zero_grad"
            opt.zero_grad(set_to_none=step.set_to_none)
            phase = f"step {k}: forward/backward"
            x, y = make_batch(case.model, case.seed, k, case.batch, case.seq, device, dtype)
            loss, full_loss = target.loss(model, x, y)
            loss.backward()
            traced = trace.take() if trace else None
            phase = f"step {k}: gather grads"
            grads = {n: None if p.grad is None else target.full(p.grad).detach().clone() for n, p in model.named_parameters()}
            spread = {}
            for n, p in model.named_parameters():
                s = target.grad_spread(p.grad) if p.grad is not None and hasattr(target, "grad_spread") else None
                if s is not None:
                    spread[n] = s
            phase = f"step {k}: optimizer.step"
            opt.step()
            phase = f"step {k}: gather params and state"
            rec = {
                "loss": full_loss.detach().clone(),
                "grads": grads,
                "grad_spread": spread,
                "params": {n: target.full(p).detach().clone() for n, p in model.named_parameters()},
                "state": state_by_fqn(opt, model, target.full),
                "groups": group_hparams(opt),
                "trace": traced,
            }
            if keep:
                steps.append(rec)
        return ({"init": init, "init_state": init_state, "steps": steps} if keep else None), None
    except Exception as e:
        return None, {**_exc(e), "phase": phase}


# ---- the case -------------------------------------------------------------
CASE_JSON = r"""
{
 "batch": 1,
 "device": "cpu",
 "dtype": "float32",
 "format": 1,
 "frozen": [],
 "groups": [
  {
   "overrides": {},
   "params": [
    "layers.0.weight",
    "layers.1.conv.weight",
    "layers.2.conv.weight",
    "layers.3.weight",
    "layers.4.weight",
    "layers.4.bias"
   ]
  },
  {
   "overrides": {},
   "params": []
  },
  {
   "overrides": {},
   "params": []
  }
 ],
 "mesh_shape": [
  2
 ],
 "model": {
  "buffer": false,
  "d_in": 1,
  "input": "tokens",
  "layers": [
   {
    "act": "",
    "bias": true,
    "children": [],
    "d_in": 1,
    "d_out": 1,
    "kernel": 1,
    "kind": "embedding"
   },
   {
    "act": "",
    "bias": false,
    "children": [],
    "d_in": 1,
    "d_out": 5,
    "kernel": 1,
    "kind": "conv1d"
   },
   {
    "act": "",
    "bias": false,
    "children": [],
    "d_in": 5,
    "d_out": 1,
    "kernel": 1,
    "kind": "conv1d"
   },
   {
    "act": "",
    "bias": false,
    "children": [],
    "d_in": 1,
    "d_out": 1,
    "kernel": 1,
    "kind": "linear"
   },
   {
    "act": "",
    "bias": true,
    "children": [],
    "d_in": 1,
    "d_out": 1,
    "kernel": 1,
    "kind": "linear"
   }
  ],
  "tie_head": false,
  "unused": false
 },
 "optim": {
  "kwargs": {
   "amsgrad": false,
   "betas": [
    0.9,
    0.999
   ],
   "decoupled_weight_decay": false,
   "eps": 1e-08,
   "foreach": true,
   "lr": 0.001,
   "maximize": false,
   "weight_decay": 0.0
  },
  "name": "Adam",
  "named": false,
  "tensor_lr": ""
 },
 "schedule": [
  {
   "freeze": [],
   "set_to_none": false,
   "unfreeze": []
  }
 ],
 "seed": 0,
 "seq": 1,
 "target": "dtensor",
 "target_options": {
  "placements": {
   "layers.0.weight": [
    "R"
   ],
   "layers.1.conv.weight": [
    "S0"
   ],
   "layers.2.conv.weight": [
    "S1"
   ],
   "layers.3.weight": [
    "R"
   ],
   "layers.4.bias": [
    "R"
   ],
   "layers.4.weight": [
    "R"
   ]
  }
 },
 "world_size": 2
}
"""
TARGET = DTensorTarget


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--setup", help="a Python file run before the case (a patch of torch, e.g. a planted bug)")
    args = ap.parse_args()
    if args.setup:
        exec(compile(open(args.setup).read(), args.setup, "exec"), {"__name__": "__fuzzshard_setup__", "__file__": args.setup})
    torch.set_num_threads(1)
    case = Case.from_json(CASE_JSON)
    if int(os.environ.get("WORLD_SIZE", "0")) != case.world_size:
        print(f"run me with: torchrun --nproc-per-node {case.world_size} {sys.argv[0]}", file=sys.stderr)
        return 2
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    device = "cpu"
    if case.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if case.device == "cuda" else "gloo", timeout=timedelta(seconds=120))
    names = tuple(f"d{i}" for i in range(len(case.mesh_shape)))
    mesh = init_device_mesh(case.device, case.mesh_shape, mesh_dim_names=names)
    rank = dist.get_rank()
    verdict = run_case(case, mesh, TARGET, device, reporter=rank == 0)
    if verdict is None or verdict["status"] == "pass":
        if rank == 0:
            print("PASS: the sharded run matches the reference")
        dist.destroy_process_group()
        return 0
    shown = {k: v for k, v in verdict.items() if k not in ("mismatches",)}
    print(f"rank {rank}: {verdict['status'].upper()}:", json.dumps(shown, indent=1, default=str))
    if verdict["status"] == "invalid":
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(_main())
