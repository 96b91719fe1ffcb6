"""A user's own model, fuzzed from this one file:

    fuzzshard fuzz --plugin examples/tiny_llm.py --target dtensor,fsdp2

TinyLLM is a small Llama-style decoder: token embedding, blocks of
[RMSNorm -> causal self-attention (wq, wk, wv, wo through
scaled_dot_product_attention, rotary position embeddings) -> residual,
RMSNorm -> SwiGLU MLP (w1, w3, w2) -> residual], a final norm and an output
head over the vocabulary. Its sizes are drawn small (heads, head dim, hidden
width, vocabulary, blocks), so shrinking goes to one block and one head.

Each case draws its model from fuzzshard's random topologies or from this
one (about half the cases); the reference is the same TinyLLM, unsharded,
built from the same seed. examples/titan_parallelize.py shards it the way
torchtitan does.
"""
import hypothesis.strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

from fuzzshard import plugin


# (its own copy of fuzzshard.kernel.decoder.rotary: a plugin runs in a standalone repro script's world too,
# where the only fuzzshard module is the script's plugin shim)
def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over [B, L, H, D] (D even: pairs rotate; an odd last dim stays)."""
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
    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        # -1 heads: under TP each rank holds its own heads (torchtitan does the same)
        q, k, v = (w(x).view(B, L, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, head_dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLLM(nn.Module):
    def __init__(self, d_in: int, n_heads: int, head_dim: int, hidden: int, n_layers: int):
        super().__init__()
        dim = n_heads * head_dim
        self.tok_embeddings = nn.Embedding(d_in, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, head_dim, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, d_in, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def tiny_llm(d_in: int, n_heads: int, head_dim: int, hidden: int, n_layers: int) -> TinyLLM:
    return TinyLLM(d_in, n_heads, head_dim, hidden, n_layers)


SIZES = st.fixed_dictionaries({
    "d_in": st.integers(2, 9),  # the vocabulary
    "n_heads": st.integers(1, 4),
    "head_dim": st.integers(1, 4),
    "hidden": st.integers(1, 8),
    "n_layers": st.integers(1, 2),
})

plugin.model(tiny_llm, sizes=SIZES, tokens=True)
