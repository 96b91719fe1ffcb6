"""Gradient sync over accumulation microbatches, and the loss scaling around it (fsdp2, fsdp1).

A data-parallel target's ``target_options["sync"]`` (absent: the target's plain accumulation) says:
  - ``skip``: how every microbatch but the last skips the gradient sync. "all": FSDP2's
    ``set_requires_gradient_sync(False)`` on every unit, FSDP1's ``no_sync()``; "root": FSDP2's on the
    root's own params only (``recurse=False``: the other units reduce every microbatch, torch's
    test_gradient_accumulation "root_only"); "all_reduce": HSDP, ``set_requires_all_reduce(False)``:
    reduce-scatter every microbatch, all-reduce only the last one's (and the partial sums); "none":
    reduce every microbatch (torchtitan's accumulation);
  - ``last_backward``: FSDP2's ``set_is_last_backward(last)``; ``keep_unsharded``: FSDP2's
    ``set_reshard_after_backward(last)`` (unsharded params kept between microbatches);
  - ``divide``: FSDP2's ``set_gradient_divide_factor(f)`` on every unit (``divide_api`` "reduce_scatter":
    through its deprecated alias ``set_reduce_scatter_divide_factor``); ``force_sum``:
    ``set_force_sum_reduction_for_comms(True)`` (gloo has no PREMUL_SUM: on CPU a factor over more than one
    data-parallel rank takes it; on one, FSDP2 divides the copy itself);
  - ``loss``: how each microbatch's loss is scaled, as frameworks do. "mean" (absent): the microbatch's
    mean loss / microbatches; "sum": its mean loss, unscaled (the grads add over the microbatches);
    "tokens": the sum of its per-token losses over the global token count (the tokens whose weight is
    not 0 over every rank and microbatch), times the divide factor (torchtitan's, with a factor of 1:
    ``set_gradient_divide_factor(1.0)``); ``mask``: the tokens' weights by block (the global batch cut
    into dp x microbatches equal blocks, rank-major as the ranks take their slices: 1 every sample, 0
    none (a rank or microbatch that sees no tokens), 2 the first half of the block's samples).
With FSDP's reduction dividing by the factor f (default: the data-parallel size dp), every rank's
microbatch losses l(r, i) give the grad of J = sum_{r,i} l(r, i) / f, the global objective the
reference computes unsharded on the whole batch (``reference_scale``, ``objective``): "mean":
dp / f x the global mean loss; "sum": dp x microbatches / f x it; "tokens": the weighted sum over the
global token count (f cancels). ``forward_backward`` returns J; the reference's loss is J too.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

LOSSES = ("mean", "sum", "tokens")
SKIPS = ("all", "none", "root", "all_reduce")
# FSDP2's controls a sync option calls, by key: drawn only where this torch's FSDPModule has them (torch >= 2.9)
FSDP2_API = {"skip": "set_requires_gradient_sync", "all_reduce": "set_requires_all_reduce",
             "last_backward": "set_is_last_backward", "keep_unsharded": "set_reshard_after_backward",
             "divide": "set_gradient_divide_factor", "divide_api": "set_reduce_scatter_divide_factor",
             "force_sum": "set_force_sum_reduction_for_comms"}


def fsdp2_has(name: str) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, name)


def dp_of(mesh_shape, options: dict) -> int:
    """The data-parallel size: the mesh's (fsdp2 under TP: its outer dim)."""
    return mesh_shape[0] if options.get("tp") else math.prod(mesh_shape)


def factor(sync: dict, dp: int) -> float:
    """What FSDP divides the summed grads by: the drawn factor, else the data-parallel size."""
    return float(sync.get("divide") or dp)


# ---- drawing ----

def draw_sync(draw, case, *, fsdp2: bool) -> dict | None:
    """The sync controls and loss scaling of ``case`` (its options, mesh, microbatches and device known),
    one case in four (fsdp2's HSDP: most); each piece drawn off first, so a shrunk case has none."""
    import hypothesis.strategies as st

    opts = case.target_options
    # FSDP2's HSDP (a replicate dim of 2+ ranks), where the divide factors differ from FSDP's (a factor applied on
    # top of the replicate dim's averaging): most cases, and there the divide factor most of the time too. Off only
    # where two draws are both 0 (still the shrunk case): Hypothesis draws an integer's least value far more often
    # than its share (one 0..3 draw here: 0 in 32 of 53 HSDP cases), so "not 0" alone came one time in three
    replicated = fsdp2 and len(case.mesh_shape) == 2 and not opts.get("tp") and case.mesh_shape[0] > 1

    def mostly():
        return draw(st.integers(0, 3)) != 0 or draw(st.integers(0, 3)) != 0

    if opts.get("mp") or not (mostly() if replicated else draw(st.integers(0, 3)) == 3):
        return None  # (mixed precision: its reference replays plain sync)
    from .moe import moe_configs_of

    if moe_configs_of(case.model) or opts.get("float8"):  # (sync_problem(), float8_problem(): their references)
        return None
    m, dp = opts.get("microbatches", 1), dp_of(case.mesh_shape, opts)
    hsdp = (len(case.mesh_shape) == 2 and not opts.get("tp")) if fsdp2 else opts.get("strategy") in (
        "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    skips = ["all", "none"]
    if fsdp2 and m > 1:
        skips.append("root")
        if hsdp and fsdp2_has("set_requires_all_reduce"):
            skips.append("all_reduce")
    out = {"skip": draw(st.sampled_from(skips))}
    if fsdp2:
        if draw(st.booleans()) and fsdp2_has("set_is_last_backward"):
            out["last_backward"] = True
        if draw(st.booleans()) and fsdp2_has("set_reshard_after_backward"):
            out["keep_unsharded"] = True
    tokens_ok = not opts.get("nonroot") and not opts.get("loss_parallel")
    loss = draw(st.sampled_from(["mean", "sum", "tokens"] if tokens_ok else ["mean", "sum"]))
    if loss != "mean":
        out["loss"] = loss
    if loss == "tokens":
        mask = [draw(st.sampled_from([1, 0, 2])) for _ in range(dp * m)]
        if not any(mask):
            mask[-1] = 1
        out["mask"] = mask
    if fsdp2 and fsdp2_has("set_gradient_divide_factor") and (
            mostly() if replicated else draw(st.booleans())):
        # torchtitan's 1 (the loss scaled by the global token count), the default made explicit, twice it
        out["divide"] = draw(st.sampled_from([1.0, float(dp), float(2 * dp)]))
        if fsdp2_has("set_reduce_scatter_divide_factor") and draw(st.integers(0, 3)) == 3:
            out["divide_api"] = "reduce_scatter"
    if fsdp2 and fsdp2_has("set_force_sum_reduction_for_comms") and (
            (out.get("divide") and case.device == "cpu" and dp > 1) or draw(st.booleans())):
        out["force_sum"] = True
    return out


def sync_problem(case, mesh_shape, options: dict, *, fsdp2: bool) -> str | None:
    """What a sync option cannot be (Case.check, through the target's check)."""
    sync = options.get("sync")
    if not sync:
        return None
    if options.get("mp"):
        return "sync controls with mixed precision: its reference accumulates as the plain sync does"
    from .dropout import has_dropout  # (lazy: kernel/moe.py and dropout.py import torch's distributed pieces)
    from .moe import moe_configs_of

    if has_dropout(case.model) or moe_configs_of(case.model):
        # the reference's global objective is one forward over the whole batch: its dropout masks, MoE routing
        # counts and aux loss are not those of the ranks' microbatches (kernel/dropout.py, kernel/moe.py)
        return "sync controls with dropout or an MoE layer: the reference's one forward is not the ranks' microbatches"
    skip = sync.get("skip", "all")
    if skip not in (SKIPS if fsdp2 else ("all", "none")):
        return f"sync skip {skip!r}: want one of {list(SKIPS if fsdp2 else ('all', 'none'))}"
    if skip == "all_reduce" and (len(mesh_shape) != 2 or options.get("tp")):
        return "sync skip 'all_reduce' (set_requires_all_reduce) is HSDP's: a 2-D mesh without TP"
    if fsdp2:
        for key, name in FSDP2_API.items():
            wanted = sync.get(key) and (key != "skip" or sync[key] != "none")
            if key == "skip" and skip == "all_reduce":
                name = FSDP2_API["all_reduce"]
            if wanted and not fsdp2_has(name):
                return f"sync {key}: this torch's FSDPModule has no {name}"
        if sync.get("divide") and not sync.get("force_sum") and case.device == "cpu" and dp_of(mesh_shape, options) > 1:
            return "a gradient divide factor reduces with PREMUL_SUM, which gloo has not: on CPU it takes force_sum"
    elif any(k in sync for k in ("last_backward", "keep_unsharded", "divide", "force_sum")):
        return "FSDP1 has no set_is_last_backward / set_reshard_after_backward / divide factor / force_sum"
    loss = sync.get("loss", "mean")
    if loss not in LOSSES:
        return f"sync loss {loss!r}: want one of {list(LOSSES)}"
    if loss == "tokens":
        mask = sync.get("mask") or []
        if options.get("nonroot") or options.get("loss_parallel"):
            return "a loss over the global token count weighs the plain loss's tokens: no nonroot or loss_parallel"
        if not mask or not any(mask) or any(v not in (0, 1, 2) for v in mask):
            return "a token mask is a list of 0, 1, 2 with some tokens weighed"
        if case.batch % len(mask):
            return f"the token mask's {len(mask)} blocks do not divide the batch ({case.batch})"
    elif "mask" in sync:
        return "a token mask goes with loss 'tokens'"
    return None


# ---- the loss ----

def weights(sync: dict, batch: int, device=None) -> torch.Tensor | None:
    """Each global sample's weight (0 or 1) under loss "tokens"; None otherwise."""
    if sync.get("loss") != "tokens":
        return None
    mask = sync["mask"]
    block = batch // len(mask)
    w = torch.zeros(batch)
    for j, v in enumerate(mask):
        if v:
            w[j * block: j * block + (block if v == 1 else (block + 1) // 2)] = 1.0
    return w if device is None else w.to(device)


def token_sum(out: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over tokens of the per-token loss (model.loss_fn's terms) weighed by its sample's weight."""
    if not target.is_floating_point():
        per = F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1), reduction="none").view(target.shape)
    else:
        per = (out - target) ** 2
    return (per.flatten(1).sum(1) * w.to(per.dtype)).sum()


def token_count(sync: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """The global token count: the weighed samples' loss terms."""
    w = weights(sync, y.shape[0])
    per = math.prod(y.shape[1:])  # cross-entropy: a term per position; MSE: per element of the target
    return float(w.sum().item()) * per


def objective_tokens(model, x, y, sync: dict) -> torch.Tensor:
    """The reference's objective under loss "tokens", on the whole global batch: the weighed token sum over
    the global token count."""
    w = weights(sync, x.shape[0], x.device)
    return token_sum(model(x), y, w) / token_count(sync, x, y)


def reference_scale(target_cls, case, k: int) -> float:
    """J / the plain objective on the whole batch at step k (either side of a checkpoint), under losses
    "mean" and "sum" (see the module doc); 1 without sync options or under "tokens" (``objective_tokens``)."""
    ck = case.checkpoint
    options, mesh_shape = (ck.target_options, ck.mesh_shape) if ck and k > ck.after else \
        (case.target_options, case.mesh_shape)
    sync = options.get("sync") or {}
    microbatches = target_cls.microbatches(options)
    if not sync or sync.get("loss") == "tokens":
        return 1.0
    dp = dp_of(mesh_shape, options)
    return dp / factor(sync, dp) * (microbatches if sync.get("loss") == "sum" else 1)


# ---- the sharded run ----

def forward_backward(target, model, x, y, controls, objective, reduce, loss_context=contextlib.nullcontext,
                     after=None, sync: dict | None = None) -> torch.Tensor:
    """This rank's slice in microbatches, each loss scaled as ``sync["loss"]`` says, each backward under
    ``controls(i, last)`` (a context manager: the target's sync controls); ``objective(model, x, y)`` the
    plain loss, ``reduce(t)`` sums a tensor over the data-parallel ranks in place; ``after()`` runs after the
    last backward. ``sync``: the options' own unless given. Returns J (module doc), summed in float64."""
    from torch.distributed.tensor import DTensor

    from .plain import torch_dtype

    case = target.case
    opts = case.target_options
    sync = sync or opts["sync"]
    dp, r, m = target.dp_size(), target.dp_rank(), target.microbatches(opts)
    per = x.shape[0] // dp
    rows = slice(r * per, (r + 1) * per)
    xs, ys = x[rows].chunk(m), y[rows].chunk(m)
    f = factor(sync, dp)
    w = weights(sync, x.shape[0], x.device)
    ws = w[rows].chunk(m) if w is not None else [None] * m
    scale = f / token_count(sync, x, y) if w is not None else (1.0 / m if sync.get("loss", "mean") == "mean" else 1.0)
    losses = []
    for i, (xm, ym, wm) in enumerate(zip(xs, ys, ws)):
        with controls(i, i == m - 1), loss_context():
            loss = (token_sum(model(xm), ym, wm) if wm is not None else objective(model, xm, ym)) * scale
            target.backward(loss)
        losses.append(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())
    if after is not None:
        after()
    total = torch.stack(losses).double().sum()
    reduce(total)
    return (total / f).to(torch_dtype(case))


@contextlib.contextmanager
def fsdp2_controls(model, sync: dict, last: bool):
    """FSDP2's controls before microbatch i's forward, as torch's test_gradient_accumulation sets them."""
    skip = sync.get("skip", "all")
    if skip == "all":
        model.set_requires_gradient_sync(last)
    elif skip == "root":
        model.set_requires_gradient_sync(last, recurse=False)
    elif skip == "all_reduce":
        model.set_requires_all_reduce(last)
    if sync.get("keep_unsharded"):
        model.set_reshard_after_backward(last)
    if sync.get("last_backward"):
        model.set_is_last_backward(last)
    yield


def fsdp2_reduce_options(model, sync: dict) -> None:
    """The divide factor and sum-only comms, on every FSDP unit (neither setter recurses)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        if sync.get("divide"):
            how = "set_reduce_scatter_divide_factor" if sync.get("divide_api") == "reduce_scatter" else \
                "set_gradient_divide_factor"
            getattr(unit, how)(sync["divide"])
        if sync.get("force_sum"):
            unit.set_force_sum_reduction_for_comms(True)


def sync_cells(options: dict) -> set:
    """A sync case's cells: how it skips, each control, the loss scaling, a zero-weight block."""
    sync = options.get("sync")
    if not sync:
        return set()
    cells = {f"skip {sync.get('skip', 'all')}", f"loss {sync.get('loss', 'mean')}"}
    cells |= {k for k in ("last_backward", "keep_unsharded", "force_sum") if sync.get(k)}
    if sync.get("divide"):
        cells.add("divide 1" if sync["divide"] == 1 else "divide")
    if 0 in (sync.get("mask") or ()):
        cells.add("zero-weight block")
    if options.get("microbatches", 1) > 1:
        cells.add("microbatches")
    return cells


def describe(options: dict, target: str = "fsdp2") -> str:
    """One line for ``fuzzshard show``: what the microbatches call and how the loss is scaled."""
    sync, m = options.get("sync") or {}, options.get("microbatches", 1)
    if not sync:
        return ""
    skip = sync.get("skip", "all")
    off = {"all": "no_sync()" if target == "fsdp1" else "set_requires_gradient_sync(False)",
           "root": "set_requires_gradient_sync(False, recurse=False) on the root",
           "all_reduce": "set_requires_all_reduce(False) (reduce-scatter only)", "none": None}[skip]
    parts = [f"{m} microbatch(es), " + (f"{off} on all but the last" if off else "a sync every microbatch")]
    parts += [f"{name}(last)" for key, name in (("keep_unsharded", "set_reshard_after_backward"),
                                                ("last_backward", "set_is_last_backward")) if sync.get(key)]
    if sync.get("divide"):
        parts.append(f"divide factor {sync['divide']:g}")
    if sync.get("force_sum"):
        parts.append("sum-only comms")
    loss = sync.get("loss", "mean")
    parts.append({"mean": "loss: mean / microbatches", "sum": "loss: summed over microbatches",
                  "tokens": f"loss: sum over the global token count, token mask by block {sync.get('mask')}"}[loss])
    return "; ".join(parts)


def fit(options: dict, mesh_shape) -> dict:
    """The sync options fitted to another mesh (the reducer's world and mesh edits): HSDP's all-reduce skip
    becomes the plain one off a 2-D mesh, and the token mask takes the new dp x microbatches blocks (its
    first blocks kept, the rest weighed)."""
    sync = options.get("sync")
    if not sync:
        return options
    sync = dict(sync)
    if sync.get("skip") == "all_reduce" and (len(mesh_shape) != 2 or options.get("tp")):
        sync["skip"] = "all"
    if sync.get("mask"):
        n = dp_of(mesh_shape, options) * options.get("microbatches", 1)
        mask = (list(sync["mask"]) + [1] * n)[:n]
        sync["mask"] = mask if any(mask) else mask[:-1] + [1]
    options["sync"] = sync
    return options


def divide_twice(case, mesh_shape, options: dict) -> bool:
    """A known torch bug's condition (fsdp2-divide-factor-single-rank-shard-twice): a divide factor other than 1
    on a shard group of one rank (a 1-rank mesh, HSDP with shard size 1) where _get_gradient_divide_factors
    splits it into a pre-/post-divide (sum-only comms, or a float16/float64 reduce dtype): foreach_reduce's
    single-rank branch divides its copy by the factor and the post-divide divides again."""
    sync = options.get("sync") or {}
    if not sync.get("divide") or sync["divide"] == 1:
        return False
    shard = mesh_shape[0] if options.get("tp") else mesh_shape[-1]
    return shard == 1 and bool(sync.get("force_sum") or case.dtype in ("float16", "float64"))
