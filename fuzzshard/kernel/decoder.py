"""The built-in decoder transformer: the model people shard with FSDP2 and TP.

Token embedding, ``n_layers`` pre-norm residual blocks of [norm -> self-
attention through ``F.scaled_dot_product_attention`` (causal or not, rotary
position embeddings on q and k, grouped-query: ``n_kv_heads`` divides
``n_heads``) -> residual, norm -> MLP (SwiGLU: w1, w3, w2; or GELU: w1, w2)
-> residual], a final norm and an output head over the vocabulary (tied to
the embedding or not). With ``dropout`` p > 0 (optional; absent: none), as
GPT-2's blocks: attention dropout (``F.scaled_dot_product_attention``'s
``dropout_p``) and residual dropout on the attention's and the MLP's outputs. The module names are torchtitan's Llama's, so a TP
plan reads as torchtitan's does. Trained with cross-entropy on token targets
(model.loss_fn).

The Case holds it as ``Model(factory="decoder", sizes={...})``; its sizes
are drawn in strategies/decoders.py. Everything here is plain torch: under
TP each rank sees its own heads (views with -1 heads), as torchtitan's do.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import MoE


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over [B, L, H, D]: the first 2*(D//2) features
    rotate in pairs (i, i + D//2); an odd last feature stays."""
    B, L, H, D = x.shape
    half = D // 2
    if half == 0:
        return x
    pos = torch.arange(L, dtype=x.dtype, device=x.device)[:, None]
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angle = (pos * freqs)[None, :, None, :]  # [1, L, 1, half]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.head_dim, self.n_rep, self.causal, self.p = head_dim, n_heads // n_kv_heads, causal, dropout
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if dropout:  # residual dropout (a module only where drawn: the plain decoder's modules stay as they were)
            self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (w(x).view(B, L, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        # grouped-query: each KV head serves n_rep query heads (Llama's repeat_kv)
        k, v = (t.repeat_interleave(self.n_rep, dim=2) if self.n_rep > 1 else t for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        out = self.wo(out.transpose(1, 2).reshape(B, L, -1))
        return self.resid_dropout(out) if self.p else out


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, swiglu: bool, dropout: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        if swiglu:
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        if dropout:
            self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(x) if hasattr(self, "w3") else F.gelu(self.w1(x))
        out = self.w2(h)
        return self.dropout(out) if hasattr(self, "dropout") else out


def _norm(kind: str, dim: int) -> nn.Module:
    return nn.RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim)


class Block(nn.Module):
    def __init__(self, sizes: dict):
        super().__init__()
        dim = sizes["n_heads"] * sizes["head_dim"]
        self.attention_norm = _norm(sizes["norm"], dim)
        p = sizes.get("dropout", 0.0)
        self.attention = Attention(dim, sizes["n_heads"], sizes["n_kv_heads"], sizes["head_dim"], sizes["causal"], p)
        self.ffn_norm = _norm(sizes["norm"], dim)
        moe = sizes.get("moe")  # a mixture of experts in place of the MLP (kernel/moe.py), or None
        self.feed_forward = MoE(dim, moe) if moe else FeedForward(dim, sizes["hidden"], sizes["mlp"] == "swiglu", p)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, sizes: dict):
        super().__init__()
        dim = sizes["n_heads"] * sizes["head_dim"]
        self.tok_embeddings = nn.Embedding(sizes["d_in"], dim)
        self.layers = nn.ModuleDict({str(i): Block(sizes) for i in range(sizes["n_layers"])})
        self.norm = _norm(sizes["norm"], dim)
        self.output = nn.Linear(dim, sizes["d_in"], bias=False)
        if sizes["tied"]:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two modules

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


# the keys of a decoder's sizes, and what each is
DECODER_SIZES = {
    "d_in": "the vocabulary",
    "n_layers": "blocks",
    "n_heads": "query heads (the model dim is n_heads * head_dim)",
    "n_kv_heads": "key/value heads (divides n_heads: grouped-query attention)",
    "head_dim": "features per head",
    "hidden": "the MLP's hidden width",
    "mlp": '"swiglu" (w1, w3, w2) or "gelu" (w1, w2)',
    "norm": '"rms" (nn.RMSNorm) or "layer" (nn.LayerNorm)',
    "causal": "causal attention",
    "tied": "the output head shares the embedding's weight",
}
# optional sizes: absent means none (the decoders drawn before them read as they did)
DECODER_OPTIONAL = {
    "dropout": "attention and residual dropout's p (0: none)",
    "moe": "a mixture-of-experts config (kernel/moe.py MOE_KEYS) in place of every block's MLP, or None",
}


def decoder(**sizes) -> Decoder:
    missing = sorted(set(DECODER_SIZES) - set(sizes))
    if missing:
        raise ValueError(f"decoder sizes lack {missing}")
    return Decoder(sizes)


# TP plan elements, torchtitan's: module FQN -> style (fsdp2's "tp" option for a decoder)
TP_STYLES = {
    "rowwise": "the embedding, row-wise (vocabulary-sharded), its output replicated or sequence-sharded",
    "heads": "attention: wq/wk/wv column-wise (each rank its own query and KV heads), wo row-wise",
    "mlp": "MLP: w1 (and w3) column-wise, w2 row-wise",
    "colwise": "the output head, column-wise (vocabulary-sharded logits, gathered unless loss_parallel)",
}


def plan_element(fqn: str) -> bool:
    """A TP plan's unit, by plain FQN: the embedding, a block's norms, attention
    and MLP, the final norm, the head (what localizing traces under TP)."""
    parts = fqn.split(".")
    if len(parts) == 1:
        return fqn in ("tok_embeddings", "norm", "output")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in ("attention_norm", "attention", "ffn_norm",
                                                                    "feed_forward")


def parallelize_decoder(model: Decoder, tp_mesh, plan: dict, sp: bool = False, loss_parallel: bool = False,
                        float8: dict | None = None) -> None:
    """Tensor parallelism on ``tp_mesh`` as torchtitan's ``apply_tp`` does it,
    for the plan's elements (``TP_STYLES``); ``float8`` (the tp target's, --ao) as torchtitan's float8 plan: its
    Linears take torchao's Float8ColwiseParallel / Float8RowwiseParallel and, with ``prepare_input``, their
    element a PrepareFloat8ModuleInput (kernel/float8.py). Between blocks the activation is
    replicated, or with ``sp`` (sequence parallelism) sharded on the sequence
    dim: the norms ``SequenceParallel``, a ``PrepareModuleInput`` gathering the
    sequence in front of a sharded attention or MLP, and around an element left
    whole a ``PrepareModuleInputOutput`` that gathers its input and scatters its
    output again. ``loss_parallel``: the logits stay vocabulary-sharded DTensors
    for ``torch.distributed.tensor.parallel.loss_parallel``'s cross-entropy."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    between = Shard(1) if sp else Replicate()
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, None
    colwise8, rowwise8 = colwise, rowwise
    f8 = set((float8 or {}).get("linears", ()))
    if f8:  # torchao's float8 TP styles (imported only here: torchao is optional)
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                            PrepareFloat8ModuleInput)

        colwise8, rowwise8 = Float8ColwiseParallel, Float8RowwiseParallel
        prepare = PrepareFloat8ModuleInput if float8.get("prepare_input") else None

    def whole():  # an element left unsharded, under SP: the full sequence in, this rank's part out
        return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True)

    top = {}
    if "tok_embeddings" in plan:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    elif sp:  # a replicated embedding: its output scattered over the sequence
        top["tok_embeddings"] = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    if sp:
        top["norm"] = SequenceParallel()
    if "output" in plan:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    elif sp:  # a replicated head: the final norm's sequence shards gathered into it
        top["output"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    for name, block in model.layers.items():
        inner = {}
        for part, style, col, row in (("attention", "heads", ("wq", "wk", "wv"), "wo"),
                                      ("feed_forward", "mlp", ("w1", "w3"), "w2")):
            if plan.get(f"layers.{name}.{part}") != style:
                if sp:
                    inner[part] = whole()
                continue
            low = f"layers.{name}.{part}.{row}" in f8  # the element's Linears float8 (all of them, or none)
            if low and prepare:  # the input cast to float8 once, with the first column-wise Linear's config
                inner[part] = prepare(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                      fwd_config_submodule_fqn=col[0])
            elif sp:
                inner[part] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for w in col:
                if hasattr(block.get_submodule(part), w):
                    inner[f"{part}.{w}"] = (colwise8 if low else colwise)()
            inner[f"{part}.{row}"] = (rowwise8 if low else rowwise)(output_layouts=between)
        if sp:
            inner["attention_norm"] = SequenceParallel()
            inner["ffn_norm"] = SequenceParallel()
        if inner:
            parallelize_module(block, tp_mesh, inner)
