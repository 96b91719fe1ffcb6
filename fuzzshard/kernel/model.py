"""Build a model from a Case's ``Model`` spec, deterministically from a seed:
a drawn topology (``layers``), the built-in decoder transformer
(``factory="decoder"``, decoder.py), or a plugin's model (``factory``: a
function registered with ``fuzzshard.plugin.model``, called with the drawn
sizes)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..case import Layer, Model
from .decoder import decoder
# (named here too: targets and scripts import them from here; a flattened repro's import lines carry no comment)
from .fqn import WRAPPERS, plain_fqn
from .moe import MoE, moe_param_shapes


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """{plain FQN: param}, whatever wrappers the target put in between."""
    return {plain_fqn(n): p for n, p in model.named_parameters()}


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The module at a plain FQN; a wrapper on the way answers for the module it
    wraps (the outermost one: what fully_shard of that FQN should take)."""
    mod = model
    for part in fqn.split(".") if fqn else ():
        while part not in mod._modules and any(w in mod._modules for w in WRAPPERS):
            mod = next(mod._modules[w] for w in WRAPPERS if w in mod._modules)
        mod = mod.get_submodule(part)
    return mod


# a plugin's models: name -> build(**sizes) -> nn.Module taking [B, L, d_in] floats
# (or [B, L] token ids below d_in) and giving [B, L, d_out]
USER_MODELS: dict = {}
# fuzzshard's own factories: trained on token targets with cross-entropy (loss_fn)
BUILTIN_MODELS = {"decoder": decoder}


def token_targets(spec: Model) -> bool:
    """Whether the model is trained on token targets (cross-entropy), not on drawn floats (mean squared error)."""
    return spec.factory in BUILTIN_MODELS


def tied_modules(spec: Model) -> tuple[str, ...]:
    """The modules that own a tied param (a target keeps them whole, or in the root's unit)."""
    if spec.factory == "decoder":
        return ("output", "tok_embeddings") if spec.sizes.get("tied") else ()
    return ("layers.0",) if spec.tie_head else ()


def tie_uses(spec: Model) -> tuple[str, ...]:
    """The two modules that use the tied param, the owner first (its FQN is the param's): the decoder's
    embedding and output head, a topology's embedding (layers.0) and head; () untied."""
    if spec.factory == "decoder":
        return ("tok_embeddings", "output") if spec.sizes.get("tied") else ()
    return ("layers.0", "head") if spec.tie_head and not spec.factory else ()


def reused_modules(spec: Model) -> tuple[str, ...]:
    """The FQNs of the modules one forward calls more than once, each later call on an earlier one's output:
    a twice layer's inner (``Twice``: f(f(x))); a module under one of them is called as often."""
    if spec.factory:
        return ()
    return tuple(f"layers.{i}.inner" for i, layer in enumerate(spec.layers) if layer.kind == "twice")


def reused_unit_params(spec: Model, wrap) -> set[str]:
    """The params whose unit (the deepest of the root and the ``wrap`` FQNs holding them, as fully_shard's
    nested units) is a module ``reused_modules`` calls more than once a forward."""
    reused = reused_modules(spec)
    units = sorted({"", *wrap}, key=lambda u: -u.count(".") - 1 if u else 0)  # deepest first, the root last
    out = set()
    for name in param_shapes(spec) if reused else ():
        owner = next(u for u in units if not u or name.startswith(u + "."))
        if owner and any(owner == q or owner.startswith(q + ".") for q in reused):
            out.add(name)
    return out


def _user_model(spec: Model) -> nn.Module:
    if spec.factory in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec.factory](**spec.sizes)
    if spec.factory not in USER_MODELS:
        raise ValueError(f"model {spec.factory!r} is a plugin's: pass its file (--plugin / --setup)")
    return USER_MODELS[spec.factory](**spec.sizes)


_META: dict = {}


def _meta(spec: Model) -> tuple[dict, int]:
    """(param shapes, output width) of a plugin's model, built and run on the
    meta device: no memory, no compute, no RNG drawn."""
    import json

    key = (spec.factory, json.dumps(spec.sizes, sort_keys=True), spec.input, spec.d_in)
    if key not in _META:
        with torch.device("meta"):
            m = _user_model(spec)
            if spec.factory == "decoder":  # over the vocabulary; no meta forward (an MoE's routing reads values)
                width = spec.sizes["d_in"]
            else:
                x = torch.zeros(1, 1, dtype=torch.long) if spec.input == "tokens" else torch.zeros(1, 1, spec.d_in)
                width = m(x).shape[-1]
        _META[key] = ({n: tuple(p.shape) for n, p in m.named_parameters()}, width)
    return _META[key]


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
    if k == "dropout":
        return nn.Dropout(layer.p)
    if k == "seq":
        return nn.Sequential(*[_build(c) for c in layer.children])
    if k == "residual":
        return Residual(nn.Sequential(*[_build(c) for c in layer.children]))
    if k == "twice":
        return Twice(nn.Sequential(*[_build(c) for c in layer.children]))
    if k == "moe":
        return MoE(layer.d_in, layer.moe)
    raise ValueError(f"unknown layer kind {k!r}")


def build_model(spec: Model, seed: int, device: str, dtype: torch.dtype) -> nn.Module:
    """The same seed gives bitwise the same initial model on every rank."""
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone, what fork_rng restores: torch.manual_seed would seed CUDA's too, which on
        # a machine without CUDA queues the call with a formatted stack each time (a third of a millisecond)
        torch.random.default_generator.manual_seed(seed)
        net = _user_model(spec) if spec.factory else Net(spec)
    return net.to(device=device, dtype=dtype)


def out_dim(spec: Model) -> int:
    if spec.factory:
        return _meta(spec)[1]
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
    if spec.factory:
        return dict(_meta(spec)[0])
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
    elif k == "moe":
        for n, shape in moe_param_shapes(layer.d_in, layer.moe).items():
            out[f"{prefix}.{n}"] = shape
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
    if token_targets(spec):  # the next tokens, as drawn: any of the vocabulary
        y = torch.randint(0, out_dim(spec), (batch, seq), generator=g)
    else:
        y = torch.randn(batch, seq, out_dim(spec), generator=g).to(dtype)
    return x.to(device), y.to(device)


def loss_fn(out, target):
    """Cross-entropy over the vocabulary for token targets, else mean squared error; a mean over all positions."""
    if not target.is_floating_point():
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))
    return ((out - target) ** 2).mean()
