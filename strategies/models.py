"""Random model topologies: nested trees of Linear, Embedding, LayerNorm,
Conv1d and activations, with residual blocks, a block called twice, tied
weights, an unused submodule and a buffer.

``dropouts``: now and then dropout in a drawn model (a layer at the end of the
top level or of a residual/twice body, or the decoder's attention and residual
dropout), drawn after the rest of the case; it shrinks to none.

``decoders``: the built-in decoder transformer (kernel/decoder.py), drawn
where a session asks for it (``--models decoder``). A plugin's models
(``fuzzshard.plugin.model``) are drawn beside them: ``user_models``.

Dims come from a small range so that many are not divisible by the world
size and some are smaller than it (empty shards). Smaller dims, fewer layers
and plain Linear shrink first.
"""
from __future__ import annotations

import dataclasses

import hypothesis.strategies as st

from fuzzshard.case import Layer, Model

ACTS = ["relu", "tanh", "gelu", "silu"]
KINDS = ["linear", "act", "layernorm", "conv1d", "residual", "twice"]
# a mixture-of-experts layer (kernel/moe.py), d -> d: not among KINDS (drawn per layer it would fill the
# topologies); one now and then, after the body (``MOE_ODDS``), shrinking to none
MOE_KIND = "moe"
MOE_ODDS = 8  # one topology or decoder in 8 has MoE (a target's Spec.moe "odds" may say otherwise: dtensor's 0)


@st.composite
def moe_configs(draw, whole_batch: bool = True, microbatched: bool = False, aux: bool = True,
                bias: bool = True, experts_multiple: int = 1) -> dict:
    """An MoE config (kernel/moe.py MOE_KEYS), each key shrinking to its plainest: 2 experts of hidden 1,
    top-1 softmax, no shared expert, dropless, no aux loss, no routing bias, the for-loop. Token dropping by
    a capacity factor only where every forward sees the whole global batch (``whole_batch``: a rank that
    runs a slice drops by its own slice, which one process over the global batch does not); a batch-wise aux
    loss only where no rank runs its slice in microbatches (its counts are summed over the data-parallel
    ranks, not over a rank's microbatches: torchtitan bans it under PP too); no aux loss at all where ``aux``
    is False (pp: its grad of one is not the schedule's loss scaling); no routing bias where ``bias`` is False
    (pp: the schedule's first step runs each stage's forward once more to infer shapes, on torch.empty
    activations past the first stage, and an MoE counts those tokens too: tests/data/moe/). ``experts_multiple``:
    the expert count a multiple of it (ep's: the experts divide over the EP degree), 2 to 4 (or the multiple)."""
    if experts_multiple > 1:  # (1: the draw as it was, for every other target)
        experts = draw(st.sampled_from([e for e in range(2, max(4, experts_multiple) + 1) if e % experts_multiple == 0]))
    else:
        experts = draw(st.integers(2, 4))
    cfg = {"experts": experts, "hidden": draw(st.integers(1, 4)), "top_k": draw(st.integers(1, min(2, experts)))}
    extra = {
        "score": draw(st.sampled_from(["softmax", "sigmoid"])),
        "route_norm": draw(st.booleans()),
        "route_scale": draw(st.sampled_from([1.0, 2.5])),
        "shared": draw(st.integers(0, 3)),
        "capacity": draw(st.sampled_from([None, 1.0, 0.5, 1.5])) if whole_batch else None,
        "aux": draw(st.sampled_from([None, "seq"] + ([] if microbatched else ["batch"]))) if aux else None,
        "bias_coeff": draw(st.sampled_from([None, 1e-3, 0.25])) if bias else None,
        "grouped": draw(st.booleans()),
        "score_before_experts": not draw(st.booleans()),
    }
    defaults = {"score": "softmax", "route_norm": False, "route_scale": 1.0, "shared": 0, "capacity": None,
                "aux": None, "bias_coeff": None, "grouped": False, "score_before_experts": True}
    cfg.update({k: v for k, v in extra.items() if v != defaults[k]})  # the config says only what it changes
    return cfg


def moe_drawn(draw, odds: int = MOE_ODDS) -> bool:
    """Whether the model has an MoE layer: one in ``odds`` (shrinking to none); ``odds`` 0: none, and nothing
    drawn (a target whose default draws leave MoE to ``--models moe``: dtensor's stay the bytes they were)."""
    return odds > 0 and draw(st.integers(1, odds)) == odds


def dims(max_dim: int = 9):
    return st.integers(1, max_dim)


@st.composite
def blocks(draw, d: int, max_dim: int) -> tuple[Layer, ...]:
    """A d -> d body for residual/twice: Linear(d, h) [act] [Linear(h, d)]."""
    h = draw(dims(max_dim))
    body = [Layer("linear", d, h, bias=draw(st.booleans()))]
    if draw(st.booleans()):
        body.append(Layer("act", act=draw(st.sampled_from(ACTS))))
    body.append(Layer("linear", h, d, bias=draw(st.booleans())))
    return tuple(body)


@st.composite
def layers(draw, d: int, max_dim: int) -> tuple[Layer, int]:
    kind = draw(st.sampled_from(KINDS))
    if kind == "linear":
        out = draw(dims(max_dim))
        return Layer("linear", d, out, bias=draw(st.booleans())), out
    if kind == "act":
        return Layer("act", act=draw(st.sampled_from(ACTS))), d
    if kind == "layernorm":
        if d < 2:
            # LayerNorm over one feature outputs its bias whatever the input: grads through
            # it are pure rounding noise amplified by 1/sqrt(eps), not comparable numbers
            return Layer("act", act="tanh"), d
        return Layer("layernorm", d, d, bias=draw(st.booleans())), d
    if kind == "conv1d":
        out = draw(dims(max_dim))
        return Layer("conv1d", d, out, bias=draw(st.booleans()), kernel=draw(st.sampled_from([1, 3]))), out
    return Layer(kind, d, d, children=draw(blocks(d, max_dim))), d


@st.composite
def models(draw, depth: int, max_dim: int = 9, moe: dict | None = None, always: bool = False,
           odds: int = MOE_ODDS) -> Model:
    """``moe``: moe_configs' arguments where this target takes an MoE layer (None: none drawn); ``always``:
    every topology has one (the "moe" family); else one in ``odds`` (moe_drawn)."""
    tokens = draw(st.booleans())
    d_in = draw(dims(max_dim))
    body: list[Layer] = []
    d = d_in
    if tokens:
        d = draw(dims(max_dim))
        body.append(Layer("embedding", d_in, d))
    for _ in range(depth):
        layer, d = draw(layers(d, max_dim))
        body.append(layer)
    if moe is not None and (always or moe_drawn(draw, odds)):
        body.append(Layer(MOE_KIND, d, d, moe=draw(moe_configs(**moe))))
    tie = tokens and draw(st.booleans())
    if tie and d != body[0].d_out:  # the tied head maps the embedding dim back to the vocab
        body.append(Layer("linear", d, body[0].d_out, bias=False))
    return Model(
        input="tokens" if tokens else "features",
        d_in=d_in,
        layers=tuple(body),
        tie_head=tie,
        unused=draw(st.booleans()),
        buffer=draw(st.booleans()),
    )


# what --models names; "moe": every case of the other families named (topologies where none is) has an MoE
# layer, where the target takes one
FAMILIES = ("topologies", "decoder", "moe")

DROPOUT_P = [0.5, 0.25, 0.1]  # the first is what a drawn dropout shrinks to: half the units, the plainest mask
DROPOUT_ONE_IN = 3  # a model with dropout: one draw in this many (a --dropout session, where the target draws it)


@st.composite
def dropouts(draw, model: Model) -> Model:
    """``model`` with dropout, one draw in DROPOUT_ONE_IN (0 first: none, what it shrinks to). A topology
    gets ``Layer("dropout", p=p)`` at the end of some residual/twice bodies (residual dropout; a twice body
    draws two masks a forward) and/or at the end of the top level: added last, so no param's name moves and
    the groups, placements and options drawn before it stay right. A decoder: ``sizes["dropout"] = p``. A
    plugin's model: none."""
    if model.factory not in ("", "decoder") or draw(st.integers(0, DROPOUT_ONE_IN - 1)) < DROPOUT_ONE_IN - 1:
        return model
    p = draw(st.sampled_from(DROPOUT_P))
    if model.factory == "decoder":
        return dataclasses.replace(model, sizes={**model.sizes, "dropout": p})
    inside = {i for i, layer in enumerate(model.layers) if layer.kind in ("residual", "twice") and draw(st.booleans())}
    layers = [dataclasses.replace(layer, children=layer.children + (Layer("dropout", p=p),)) if i in inside else layer
              for i, layer in enumerate(model.layers)]
    if not inside or draw(st.booleans()):
        layers.append(Layer("dropout", p=p))
    return dataclasses.replace(model, layers=tuple(layers))


@st.composite
def decoders(draw, max_layers: int = 2, moe: dict | None = None, always: bool = False, odds: int = MOE_ODDS) -> Model:
    """The decoder's sizes (kernel/decoder.py's DECODER_SIZES). Each shrinks to
    the smallest: one block, one head, head dim 1, a SwiGLU MLP of width 1,
    RMSNorm, non-causal, untied. Up to ``max_layers`` blocks (pp's stages need more). Head counts are drawn small, so some do not
    divide a TP degree (TP then leaves attention whole: strategies draw the plan)."""
    n_layers = draw(st.integers(1, max_layers))
    n_heads = draw(st.integers(1, 4))
    n_kv_heads = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    head_dim = draw(st.integers(1, 4))
    sizes = {
        "d_in": draw(st.integers(2, 9)),  # the vocabulary
        "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
        "hidden": draw(st.integers(1, 8)),
        "mlp": draw(st.sampled_from(["swiglu", "gelu"])),
        # LayerNorm over one feature outputs its bias whatever the input (grads through it are rounding noise)
        "norm": draw(st.sampled_from(["rms", "layer"])) if n_heads * head_dim > 1 else "rms",
        "causal": draw(st.booleans()),
        "tied": draw(st.booleans()),
    }
    if moe is not None and (always or moe_drawn(draw, odds)):  # drawn last: shrinks to the MLP
        sizes["moe"] = draw(moe_configs(**moe))
    return Model(input="tokens", d_in=sizes["d_in"], layers=(), factory="decoder", sizes=sizes)


# a plugin's models: name -> (strategy of its sizes dicts, whether it takes token ids)
USER: dict[str, tuple] = {}


def register(name: str, sizes, tokens: bool) -> None:
    USER[name] = (sizes, tokens)


@st.composite
def user_models(draw, names: list[str]) -> Model:
    name = draw(st.sampled_from(sorted(names)))
    sizes_strategy, tokens = USER[name]
    sizes = dict(draw(sizes_strategy))
    return Model(input="tokens" if tokens else "features", d_in=int(sizes["d_in"]), layers=(), factory=name,
                 sizes=sizes)
