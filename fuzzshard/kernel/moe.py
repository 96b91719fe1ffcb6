"""A mixture-of-experts layer shaped as torchtitan's (``torchtitan/models/moe/moe.py``).

``MoE(dim, cfg)``: ``router`` (``TokenChoiceTopKRouter``: ``gate`` Linear(dim,
experts, bias=False), top-k over softmax or sigmoid scores, optional
normalisation of the top-k scores and a scale), ``reorderer``
(``TokenReorderer``: sort the (token, k) slots by expert, stable), ``experts``
(``GroupedExperts``: params ``w1`` [E, hidden, dim], ``w2`` [E, dim, hidden],
``w3`` [E, hidden, dim], SwiGLU per expert over tokens already sorted by
expert: a for-loop over experts, or ``torch._grouped_mm``), an optional
``shared_experts`` (a SwiGLU SharedExpert every token goes through), the
auxiliary-loss-free load balancing of DeepSeek-V3 (a persistent
``expert_bias`` buffer added to the scores for the top-k choice only, moved
outside the optimizer by ``update_expert_bias`` from the ``tokens_per_expert``
buffer, summed over the data-parallel ranks: torchtitan's optimizer pre-hook),
token dropping by a capacity factor (Switch Transformer's; None: dropless, as
torchtitan) and an auxiliary load-balancing loss (sequence-wise, DeepSeek-V3's
Eqs 17-20, or batch-wise, as Hugging Face's ``load_balancing_loss_func``), put
into the backward the way torchtitan does: an autograd function that leaves
the forward value alone and hands the aux loss a grad of one.

The config is a plain JSON dict (``MOE_KEYS``), what a Case holds. Every op
is deterministic on CPU (float32, float64, bfloat16); the router's scores are
float32 at least (torchtitan's), float64 in a float64 model.

Routing is a discrete choice made from floats: a sharded run whose gate logits
differ from the reference's by rounding may pick another expert where two
scores nearly tie, and then every later number differs by O(1). ``margin``
(the smallest gap, over every forward since the harness reset it, between a
token's k-th chosen score and its best unchosen one) lets the harness tell such a case from a bug: docs/oracles.md.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fqn import plain_fqn

# the keys of an MoE config, and what each is (the off-value first: what a draw shrinks to)
MOE_KEYS = {
    "experts": "routed experts E",
    "hidden": "each expert's hidden width (w1, w3: [E, hidden, dim]; w2: [E, dim, hidden])",
    "top_k": "experts per token (<= E)",
    "score": '"softmax" or "sigmoid" router scores',
    "route_norm": "the top-k scores divided by their sum",
    "route_scale": "the top-k scores times this",
    "shared": "hidden width of the shared expert (0: none)",
    "capacity": "capacity factor: an expert takes at most ceil(capacity * T * top_k / E) of a forward's T "
                "tokens, the rest dropped (their slot adds nothing); None: dropless",
    "aux": 'auxiliary load-balancing loss: None, "seq" (sequence-wise) or "batch" (batch-wise)',
    "aux_coeff": "its coefficient",
    "bias_coeff": "load-balancing routing bias (expert_bias) step size; None: no bias",
    "grouped": "torch._grouped_mm for the experts in place of the for-loop, where torch runs it (grouped_mm_ok)",
    "score_before_experts": "scale the routed input by its score before the expert (else its output after)",
}

DEFAULTS = {"experts": 2, "hidden": 1, "top_k": 1, "score": "softmax", "route_norm": False, "route_scale": 1.0,
            "shared": 0, "capacity": None, "aux": None, "aux_coeff": 0.01, "bias_coeff": None, "grouped": False,
            "score_before_experts": True}


def config(cfg: dict) -> dict:
    """A full config: ``cfg`` over the defaults, checked."""
    unknown = sorted(set(cfg) - set(MOE_KEYS))
    if unknown:
        raise ValueError(f"MoE config has unknown keys {unknown}")
    c = {**DEFAULTS, **cfg}
    if not 1 <= c["top_k"] <= c["experts"]:
        raise ValueError(f"MoE top_k {c['top_k']} not in 1..experts ({c['experts']})")
    if c["score"] not in ("softmax", "sigmoid"):
        raise ValueError(f"MoE score {c['score']!r}")
    if c["aux"] not in (None, "seq", "batch"):
        raise ValueError(f"MoE aux {c['aux']!r}")
    return c


def grouped_mm_ok(dim: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs these experts on CPU (torch 2.13): float32 or bfloat16 only (float64
    is refused), and every row of the operands 16-byte aligned (dim and hidden a multiple of 4 in float32,
    of 8 in bfloat16): else "strides should be multiple of 16 bytes", forward or backward."""
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    per = 16 // torch.empty((), dtype=dtype).element_size()
    return dim % per == 0 and hidden % per == 0


class SharedExpert(nn.Module):
    """SwiGLU: the shared expert (torchtitan's MoE FeedForward)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    splits = torch.split(x, num_tokens_per_expert.tolist(), dim=0)
    outs = []
    for e, xe in enumerate(splits):
        h = F.silu(torch.matmul(xe, w1[e].transpose(-2, -1))) * torch.matmul(xe, w3[e].transpose(-2, -1))
        outs.append(torch.matmul(h, w2[e].transpose(-2, -1)))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


def _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.use_grouped_mm = use_grouped_mm
        for w, fan_in in ((self.w1, dim), (self.w2, hidden), (self.w3, dim)):
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))  # nn.Linear's bound

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x``: [N, dim], the routed slots sorted by expert; ``num_tokens_per_expert``: [E] ints."""
        from torch.distributed.tensor import DTensor

        ws = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        # torch._grouped_mm where torch runs it for these shapes and this dtype (grouped_mm_ok), else the loop
        grouped = self.use_grouped_mm and grouped_mm_ok(ws[0].shape[-1], ws[0].shape[-2], ws[0].dtype)
        run = _run_experts_grouped_mm if grouped else _run_experts_for_loop
        return run(*ws, x, num_tokens_per_expert)


class Gate(nn.Linear):
    """The router's gate: an nn.Linear that also notes, per token, the magnitude its logits are summed from
    (max over experts of sum_i |W_ei x_i|; ``MoE.record_margin``), read while its weight is whole (FSDP2
    reshards a gate of its own right after its forward)."""

    def forward(self, x):
        out = super().forward(x)
        with torch.no_grad():
            up = torch.float64 if x.dtype == torch.float64 else torch.float32
            size = (x.detach().abs().to(up) @ self.weight.detach().abs().to(up).T).amax(-1)
            self.size = size.to_local() if hasattr(size, "to_local") else size  # a Replicate DTensor under ep's TP
        return out


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, route_norm: bool,
                 route_scale: float):
        super().__init__()
        self.gate = Gate(dim, num_experts, bias=False)
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.route_norm, self.route_scale = route_norm, route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """``x`` [T, dim] -> (top_scores [T, k], selected_experts_indices [T, k], num_tokens_per_expert [E],
        scores [T, E], scores_for_choice [T, E])."""
        scores = self.gate(x)
        # float32 at least (torchtitan's: against loss explosion); float64 in a float64 model
        up = torch.float64 if scores.dtype == torch.float64 else torch.float32
        scores = torch.sigmoid(scores.to(up)) if self.score_func == "sigmoid" else F.softmax(scores.to(up), dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias.to(up)
        _, idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        # the bias steers the choice only: the gating value is the score itself
        top_scores = scores.gather(dim=-1, index=idx)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        return top_scores, idx, counts, scores, choice


class TokenReorderer(nn.Module):
    """Sorts the (token, k) slots by expert, stable: within an expert, in token order."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        flat = selected_experts_indices.reshape(-1)
        num_tokens_per_expert = torch.bincount(flat, minlength=self.num_experts)
        token_indices_experts_sorted = torch.argsort(flat, stable=True)
        return top_scores.reshape(-1)[token_indices_experts_sorted], token_indices_experts_sorted, \
            num_tokens_per_expert


def capacity_of(capacity: float, tokens: int, top_k: int, experts: int) -> int:
    """The most slots one expert takes out of a forward's ``tokens`` tokens."""
    return math.ceil(capacity * tokens * top_k / experts)


class _AuxLoss(torch.autograd.Function):
    """torchtitan's _AuxLossAutograd: the forward value stays, the aux loss gets a grad of one, times
    ``scale``: a grad scaler's scale, which the loss the backward starts from carries (torchtitan's one
    would be unscaled by it: an aux loss 1/scale as strong; the harness sets ``MoE.aux_grad``)."""

    @staticmethod
    def forward(ctx, top_scores, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return top_scores

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def aux_loss(kind: str, scores: torch.Tensor, idx: torch.Tensor, B: int, top_k: int, coeff: float,
             dp_groups=()) -> torch.Tensor:
    """The load-balancing loss of one forward: ``scores`` [B*L, E] (the router's, before the bias),
    ``idx`` [B*L, k] the chosen experts. With f_e the fraction of the routed slots expert e got, times E, and
    p_e its mean normalised score: "seq" sum_e f_e p_e per sequence, averaged over the B sequences
    (DeepSeek-V3 Eqs 17-20; additive over sequences, so over data-parallel ranks: each rank's mean, averaged
    with the grads, is the global batch's); "batch" sum_e f_e p_e over the batch, with the counts f_e summed
    over ``dp_groups`` (global, as torchtitan's all-reduce) and p_e's sum over this rank's tokens divided by
    the global token count over the ranks: averaged with the grads over the ranks, it is the global batch's."""
    E = scores.shape[-1]
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    with torch.no_grad():
        if kind == "seq":
            counts = torch.zeros(B, E, dtype=scores.dtype, device=scores.device)
            counts.scatter_add_(1, idx.reshape(B, -1), torch.ones_like(idx.reshape(B, -1), dtype=scores.dtype))
        else:
            counts = torch.bincount(idx.reshape(-1), minlength=E).to(scores.dtype)
            world = 1
            for group in dp_groups:
                import torch.distributed as dist

                dist.all_reduce(counts, group=group)
                world *= dist.get_world_size(group)
    if kind == "seq":
        p = probs.reshape(B, -1, E).mean(dim=1)
        f = counts * (E / (top_k * (counts.sum(dim=1, keepdim=True) / top_k)))
        return (f * p).sum(dim=1).mean() * coeff
    tokens = counts.sum() / top_k  # the global token count
    p = probs.sum(dim=0) / (tokens / world)
    f = counts * (E / (top_k * tokens))
    return (f * p).sum() * coeff


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: dict):
        super().__init__()
        c = self.cfg = config(cfg)
        E = c["experts"]
        self.experts = GroupedExperts(dim, c["hidden"], E, c["grouped"])
        self.router = TokenChoiceTopKRouter(dim, E, c["top_k"], c["score"], c["route_norm"], c["route_scale"])
        self.reorderer = TokenReorderer(E, c["top_k"])
        self.shared_experts = SharedExpert(dim, c["shared"]) if c["shared"] else None
        self.score_before_experts = c["score_before_experts"]
        self.load_balance_coeff = c["bias_coeff"]
        if self.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        # set by the harness on a sharded run (wire): the process groups the batch is split over (a batch-wise aux
        # loss sums its counts over them) and the sequences a rank trains on per step, of which a forward sees
        # B: its aux loss counts B / aux_batch of the step's (torchtitan's coeff * B / global_batch_size)
        self.dp_groups, self.aux_batch = (), None
        self.aux_grad = 1.0  # the aux loss's grad: the loss scale of the backward it is in (_AuxLoss)
        self.margin = math.inf  # the smallest relative routing margin seen (module docstring)
        self.tp_mesh = None  # ep's TP dim (targets/ep.py): each TP rank routes its 1/tp slice of the tokens

    def _apply(self, fn, recurse=True):
        """The load-balancing buffers stay float32 (torchtitan's) when the model is cast: a count in bfloat16
        is exact only to 256."""
        super()._apply(fn, recurse)
        for name in ("tokens_per_expert", "expert_bias"):
            b = self._buffers.get(name)
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                self._buffers[name] = b.float()
        return self

    def record_margin(self, size: torch.Tensor, choice: torch.Tensor, k: int) -> None:
        """The smallest gap between a token's k-th chosen score and its best unchosen one, relative to the
        magnitude its gate logits are summed from (max over experts of sum_i |W_ei x_i|, at least 1: a logit
        computed otherwise, or from an input that differs by rounding, moves by a multiple of u times it).
        Capacity drops are decided by token order alone, no float compare."""
        if k < choice.shape[-1] and choice.shape[0]:
            top = torch.topk(choice, k + 1, dim=-1).values
            self.margin = min(self.margin, float(((top[:, k - 1] - top[:, k]) / size.clamp(min=1.0)).min()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):  # not a param's type: FSDP2's sharded params are DTensors until unsharded
            return self._forward_local(x)
        return self._forward(x)

    def _forward_local(self, x):
        """Under DTensor params and activations (the dtensor target, a TP plan that keeps the MoE whole): the
        layer runs on full plain copies, as torchtitan's local_map region runs its experts on local tensors
        (every rank the same; the grads flow back to each param's placements through ``full_tensor``); a
        replicated buffer is its local copy, updated in place. A DTensor input gives a replicated DTensor."""
        from torch.distributed.tensor import DTensor, Replicate

        def plain(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        from torch.nn.utils.stateless import _reparametrize_module  # functional_call's, without self's hooks again

        swap = {n: plain(p) for n, p in self.named_parameters()}
        swap.update({n: b.to_local() if isinstance(b, DTensor) else b for n, b in self.named_buffers()})
        with _reparametrize_module(self, swap, tie_weights=False, strict=False):
            out = self._forward(plain(x))
        if isinstance(x, DTensor):
            return DTensor.from_local(out, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)
        tp = self.tp_mesh
        if tp is not None:  # ep's TP: torchtitan's MoE input Replicate, its routed path's grads Partial over TP
            from torch.distributed.tensor import DTensor, Partial, Replicate

            x_in = DTensor.from_local(x, tp, [Replicate()], run_check=False)
            x = x_in.to_local(grad_placements=[Partial()])
        else:
            x_in = x
        top_scores, idx, counts, scores, choice = self.router(x_in, self.expert_bias)
        with torch.no_grad():
            self.record_margin(self.router.gate.size, choice.detach(), idx.shape[-1])
            if self.training:
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        c = self.cfg
        if c["aux"] and self.training and torch.is_grad_enabled():
            coeff = c["aux_coeff"] * (bs / self.aux_batch if self.aux_batch else 1.0)
            aux = aux_loss(c["aux"], scores, idx, bs, c["top_k"], coeff, self.dp_groups)
            # under TP every rank computes it from the same scores, whose grads sum over TP: one rank's grad of one
            grad = self.aux_grad if tp is None or tp.get_local_rank() == 0 else 0.0
            top_scores = _AuxLoss.apply(top_scores, aux, grad)
        tokens = bs * slen
        if tp is not None:  # torchtitan's token dispatcher under sequence parallel (sp_size, sp_rank): a TP
            # rank routes the tokens of its 1/tp slice (bs * slen a multiple of tp: ep_check)
            n = tokens // tp.size()
            lo = tp.get_local_rank() * n
            x, top_scores, idx, tokens = x[lo:lo + n], top_scores[lo:lo + n], idx[lo:lo + n], n
        out_experts = self._routed(x, top_scores, idx, tokens, dim, bs)
        if tp is None:
            out = self.shared_experts(x) if self.shared_experts is not None else None
            out = out_experts if out is None else out + out_experts
            return out.reshape(bs, slen, dim)
        # this rank's slice in the full token range, plus the shared expert's Partial (RowwiseParallel's output):
        # one Partial sum over TP, reduced to Replicate (torchtitan's MoE output)
        full = torch.cat([out_experts.new_zeros(lo, dim), out_experts,
                          out_experts.new_zeros(bs * slen - lo - tokens, dim)])
        if self.shared_experts is not None:
            full = full + self.shared_experts(x_in)
        out = DTensor.from_local(full, tp, [Partial()], run_check=False).redistribute(tp, [Replicate()]).to_local()
        return out.reshape(bs, slen, dim)

    def _routed(self, x, top_scores, idx, tokens, dim, bs):
        """The routed experts' output [tokens, dim] of ``x`` [tokens, dim], routed as ``idx`` says."""
        c = self.cfg
        scores_sorted, slots_sorted, num_tokens_per_expert = self.reorderer(top_scores, idx)
        if c["capacity"] is not None:
            # each expert keeps its first `cap` slots in token order; the rest are dropped
            cap = capacity_of(c["capacity"], tokens, c["top_k"], c["experts"])
            starts = torch.cumsum(num_tokens_per_expert, 0) - num_tokens_per_expert
            experts_sorted = idx.reshape(-1)[slots_sorted]
            keep = (torch.arange(slots_sorted.numel(), device=x.device) - starts[experts_sorted]) < cap
            scores_sorted, slots_sorted = scores_sorted[keep], slots_sorted[keep]
            num_tokens_per_expert = num_tokens_per_expert.clamp(max=cap)
        routed_input = x[slots_sorted // c["top_k"]]
        if self.score_before_experts:
            routed_input = (routed_input.to(scores_sorted.dtype) * scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        unsorted = routed_output.new_zeros(tokens * c["top_k"], dim)
        unsorted[slots_sorted] = routed_output
        unsorted = unsorted.reshape(-1, c["top_k"], dim)
        if self.score_before_experts:
            return unsorted.sum(dim=1)
        sc = top_scores.new_zeros(tokens * c["top_k"])
        sc[slots_sorted] = scores_sorted  # a dropped slot's score multiplies zero: it gets no grad
        return torch.bmm(sc.reshape(-1, 1, c["top_k"]), unsorted.to(sc.dtype)).to(x.dtype).squeeze(1)


def moe_param_shapes(dim: int, cfg: dict) -> dict[str, tuple[int, ...]]:
    """{name inside the MoE: shape} in ``named_parameters()`` order, without building it."""
    c = config(cfg)
    E, h = c["experts"], c["hidden"]
    out = {"experts.w1": (E, h, dim), "experts.w2": (E, dim, h), "experts.w3": (E, h, dim),
           "router.gate.weight": (E, dim)}
    if c["shared"]:
        out.update({"shared_experts.w1.weight": (c["shared"], dim), "shared_experts.w2.weight": (dim, c["shared"]),
                    "shared_experts.w3.weight": (c["shared"], dim)})
    return out


def moe_configs_of(model) -> list[dict]:
    """The MoE configs of a Case's ``Model`` (its topology's moe layers, the decoder's blocks' moe)."""
    if model.factory == "decoder":
        return [model.sizes["moe"]] if model.sizes.get("moe") else []
    out = []

    def walk(layers):
        for layer in layers:
            if layer.kind == "moe":
                out.append(layer.moe)
            walk(layer.children)

    walk(model.layers)
    return out


def moe_cells(model) -> list[str]:
    """What a Case ``Model``'s MoE layers use, as coverage cells (session/schedule.py, ``show``): "moe", then
    one per feature on (top-k above 1, sigmoid, shared expert, capacity, aux loss, routing bias, grouped_mm)."""
    cfgs = moe_configs_of(model)
    if not cfgs:
        return []
    out = ["moe"]
    for c in cfgs:
        c = config(c)
        out += [f for f, on in (("moe top-k>1", c["top_k"] > 1), ("moe sigmoid", c["score"] == "sigmoid"),
                                ("moe shared expert", bool(c["shared"])), ("moe capacity", c["capacity"] is not None),
                                (f"moe aux {c['aux']}", bool(c["aux"])), ("moe expert_bias", c["bias_coeff"] is not None),
                                ("moe grouped_mm", c["grouped"]), ("moe score after experts", not c["score_before_experts"]))
                if on]
    return list(dict.fromkeys(out))


def moe_prefixes(model) -> tuple[str, ...]:
    """The FQN prefixes ("layers.3.") under which a Case ``Model``'s MoE layers hold their params."""
    if model.factory == "decoder":
        return tuple(f"layers.{i}.feed_forward." for i in range(model.sizes["n_layers"])) if model.sizes.get("moe") \
            else ()
    out = []

    def walk(layers, prefix):
        for i, layer in enumerate(layers):
            here = f"{prefix}{i}"
            if layer.kind == "moe":
                out.append(here + ".")
            walk(layer.children, here + (".inner." if layer.kind in ("residual", "twice") else "."))

    walk(model.layers, "layers.")
    return tuple(out)


def moe_problem(case, spec, microbatches) -> str | None:
    """What makes a case with MoE layers impossible for its target (Case.check asks): a target that takes none
    (its Spec's ``moe``); a capacity factor where a forward sees only part of the global batch (each rank would
    drop by its own slice, one process over the global batch by the whole: not the same model); a batch-wise
    aux loss where a rank runs microbatches (its counts are summed over the ranks, not the microbatches)."""
    cfgs = moe_configs_of(case.model)
    if not cfgs:
        return None
    if spec.moe is None:
        return f"{case.target} takes no mixture-of-experts layer"
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    for cfg in cfgs:
        try:
            config(cfg)
        except ValueError as e:
            return str(e)
        if cfg.get("capacity") is not None and not spec.moe.get("whole_batch"):
            return (f"an MoE capacity factor under {case.target}: a rank's forward drops tokens by its own slice "
                    "of the batch, which the global batch does not")
        if cfg.get("bias_coeff") is not None and spec.moe.get("bias") is False:
            return (f"an MoE routing bias under {case.target}: its first step's shape-inference forward counts "
                    "tokens the training does not route (tests/data/moe/pp_metadata_forward_counts.json)")
        if cfg.get("aux") and spec.moe.get("aux") is False:
            return f"an MoE aux loss under {case.target}: its grad of one is not {case.target}'s loss scaling"
        if cfg.get("aux") == "batch" and (spec.moe.get("microbatched") or any(microbatches(o) > 1 for o in sides)):
            return f"a batch-wise MoE aux loss under {case.target}'s microbatches: its counts are per microbatch"
    return None


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _moe_local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def wire(model: nn.Module, groups: list, batch: int) -> None:
    """A sharded run's MoE layers: the process groups the batch is split over, and the sequences per rank."""
    import torch.distributed as dist

    per = batch // math.prod(dist.get_world_size(g) for g in groups)
    for m in moe_modules(model):
        m.dp_groups, m.aux_batch = tuple(groups), per


def set_aux_grad(model: nn.Module, scale: float) -> None:
    """The grad a backward hands every MoE's aux loss: the grad scaler's scale of the loss it starts from."""
    for m in moe_modules(model):
        m.aux_grad = scale


def expert_biases(model: nn.Module) -> dict:
    """{plain FQN of an MoE: a copy of its expert_bias} of the MoE layers this rank holds (with a bias)."""
    return {plain_fqn(n): _moe_local(m.expert_bias).detach().clone() for n, m in model.named_modules()
            if isinstance(m, MoE) and m.expert_bias is not None}


def observe_biases(model: nn.Module, group, step: int) -> tuple[dict, list]:
    """Every rank's ``expert_biases``, gathered over the job's ``group``: ({fqn: the lowest holding rank's copy},
    replica mismatches: a bias whose copies differ between the ranks that hold it, bit for bit; it is made
    by one all-reduce of the counts and the same elementwise ops on every rank)."""
    import torch.distributed as dist

    from .oracles import compare_replicas

    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {n: t.cpu() for n, t in expert_biases(model).items()}, group=group)
    copies: dict = {}
    for r, part in enumerate(parts):
        for n, t in part.items():
            copies.setdefault(n, {})[r] = t
    biases = {n: c[min(c)] for n, c in copies.items()}
    replicas = [compare_replicas("moe.expert_bias", step, n, c) for n, c in sorted(copies.items()) if len(c) > 1]
    return biases, [m for m in replicas if m]


def set_biases(model: nn.Module, biases: dict | None, counts: dict | None = None) -> dict:
    """Set every MoE's expert_bias to ``biases`` ({fqn: tensor}; None: leave them) and its tokens_per_expert to
    ``counts`` (None: zeros); returns the counts it held."""
    held = {}
    with torch.no_grad():
        for n, m in model.named_modules():
            if not isinstance(m, MoE):
                continue
            n = plain_fqn(n)
            held[n] = _moe_local(m.tokens_per_expert).clone()
            if biases is not None and m.expert_bias is not None and n in biases:
                _moe_local(m.expert_bias).copy_(biases[n])
            _moe_local(m.tokens_per_expert).copy_(counts[n] if counts else torch.zeros_like(held[n]))
    return held


class Routing:
    """The expert counts and routing margin of some forwards of a copy of the model (a target's own reference
    passes, fsdp2's mixed precision), added up and handed to the model the reference reads them from."""

    def __init__(self):
        self.counts: dict = {}
        self.margin = math.inf

    def start(self, model: nn.Module) -> None:
        set_biases(model, None)
        margin(model, reset=True)

    def add(self, model: nn.Module) -> None:
        self.margin = min(self.margin, margin(model, reset=True))
        for n, t in set_biases(model, None).items():
            self.counts[n] = self.counts.get(n, 0) + t

    def put(self, model: nn.Module) -> None:
        if self.counts:
            set_biases(model, None, self.counts)
            for m in moe_modules(model):
                m.margin = self.margin


def margin(model: nn.Module, reset: bool = False) -> float:
    """The smallest relative routing margin of the model's MoE layers since the last reset (inf: none)."""
    mods = moe_modules(model)
    out = min((m.margin for m in mods), default=math.inf)
    if reset:
        for m in mods:
            m.margin = math.inf
    return out


@torch.no_grad()
def update_expert_bias(model: nn.Module, groups=()) -> None:
    """torchtitan's ``_update_expert_bias`` (its optimizer step pre-hook): every MoE's ``tokens_per_expert``
    summed over the data-parallel ``groups`` (one all-reduce of the stacked counts: the global batch's), the
    bias moved by ``bias_coeff * sign(mean - count)`` centred, the counts zeroed."""
    mods = [m for m in moe_modules(model) if m.load_balance_coeff is not None]
    if not mods:
        return
    counts = torch.vstack([_moe_local(m.tokens_per_expert).float() for m in mods])
    for group in groups:
        import torch.distributed as dist

        dist.all_reduce(counts, group=group)
    for m, t in zip(mods, counts):
        delta = m.load_balance_coeff * torch.sign(t.mean() - t)
        _moe_local(m.expert_bias).add_((delta - delta.mean()).to(m.expert_bias.dtype))
        _moe_local(m.tokens_per_expert).zero_()
