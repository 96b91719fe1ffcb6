"""The gradient sync controls and loss scaling over microbatches (kernel/sync.py), written out for the
fsdp2 and fsdp1 scripts: the sharded side's microbatch loop and the plain side's global objective."""
from __future__ import annotations

from ..case import Case
from ..kernel.sync import dp_of, factor, weights
from . import common


def unsupported(case: Case, options: dict) -> str | None:
    if not options.get("sync"):
        return None
    if case.checkpoint:
        return "sync options beside a checkpoint (the plain objective changes at the load)"
    from . import loop

    if loop.plateau(case):
        return "ReduceLROnPlateau fed the loss under sync options"
    return None


def _token_sum(case: Case, out: str, y: str, w: str) -> str:
    """kernel/sync.py token_sum: each sample's summed per-token loss, weighed by its weight, summed."""
    if not _float_targets(case):
        per = f"F.cross_entropy({out}.flatten(0, 1), {y}.flatten(0, 1), reduction=\"none\").view({y}.shape)"
    else:
        per = f"(({out} - {y}) ** 2)"
    return f"({per}.flatten(1).sum(1) * {w}).sum()"


def _float_targets(case: Case) -> bool:
    from ..kernel.model import token_targets

    return not token_targets(case.model)


def _count(case: Case, options: dict) -> float:
    """kernel/sync.py token_count, from the case's shapes: weighed samples x loss terms per sample."""
    from ..kernel.model import out_dim

    w = weights(options["sync"], case.batch)
    per = case.seq * (out_dim(case.model) if _float_targets(case) else 1)
    return float(w.sum().item()) * per


def weights_line(case: Case, options: dict) -> list[str]:
    w = weights(options["sync"], case.batch)
    if w is None:
        return []
    return [f"W = torch.tensor({[int(v) for v in w.tolist()]}, dtype=torch.{case.dtype})  # each sample's weight: "
            f"its tokens count or not", f"N = {_count(case, options)!r}  # the global token count"]


def objective(case: Case, net: str, x: str, plain: str) -> str:
    """The plain side's global objective J (kernel/sync.py): the scaled plain loss, or the weighed token sum
    over the global token count; ``plain``: the writer's plain loss expression."""
    o = case.target_options
    sync = o["sync"]
    if sync.get("loss") == "tokens":
        return f"({_token_sum(case, f'{net}({x})', 'y', 'W')} / N)"
    dp, m = dp_of(case.mesh_shape, o), o.get("microbatches", 1)
    c = dp / factor(sync, dp) * (m if sync.get("loss") == "sum" else 1)
    return plain if c == 1 else f"({plain} * {c!r})"


def loop(case: Case, options: dict, controls, loss_m: str, rows: str | None, context=None) -> list[str]:
    """The sharded side: this rank's slice (``rows``: its slice expression, None for one rank) in microbatches,
    ``controls(last)`` the lines before each forward, ``loss_m`` the plain loss of (xm, ym); ``context(last)``:
    a context each forward/backward runs in (FSDP1's no_sync)."""
    sync, m = options.get("sync") or {"skip": "all"}, options.get("microbatches", 1)
    dp = dp_of(case.mesh_shape, options)
    tokens = sync.get("loss") == "tokens"
    out = []
    if tokens:
        out.append(f"w = W[{rows}]" if rows else "w = W")
    zipped = "zip(x.chunk({m}), y.chunk({m}){w})".format(m=m, w=f", w.chunk({m})" if tokens else "")
    head = f"for i, (xm, ym{', wm' if tokens else ''}) in enumerate({zipped}):  # grad accumulation"
    if tokens:
        f = factor(sync, dp)
        loss = f"{_token_sum(case, 'model(xm)', 'ym', 'wm')} * ({f!r} / N)  # times the divide factor, over N"
    elif sync.get("loss") == "sum":
        loss = f"{loss_m}  # unscaled: the microbatches' grads add up"
    else:
        loss = f"{loss_m} / {m}"
    body = [f"loss = {loss}", "loss.backward()"]
    if context is not None:
        body = [f"with {context(f'i == {m - 1}')}:", *common.indent(body)]
    return out + [head, *common.indent(controls(f"i == {m - 1}") + body)]


def fsdp2_controls(options: dict, last: str) -> list[str]:
    sync = options["sync"]
    skip = sync.get("skip", "all")
    out = {"all": [f"model.set_requires_gradient_sync({last})"],
           "root": [f"model.set_requires_gradient_sync({last}, recurse=False)  # the root's own params only"],
           "all_reduce": [f"model.set_requires_all_reduce({last})  # HSDP: reduce-scatter each, all-reduce the last"],
           "none": []}[skip]
    if sync.get("keep_unsharded"):
        out.append(f"model.set_reshard_after_backward({last})")
    if sync.get("last_backward"):
        out.append(f"model.set_is_last_backward({last})")
    return out


def fsdp2_reduce_options(options: dict) -> list[str]:
    sync = options["sync"]
    calls = []
    if sync.get("divide"):
        how = "set_reduce_scatter_divide_factor" if sync.get("divide_api") == "reduce_scatter" else \
            "set_gradient_divide_factor"
        calls.append(f"unit.{how}({sync['divide']!r})")
    if sync.get("force_sum"):
        calls.append("unit.set_force_sum_reduction_for_comms(True)")
    if not calls:
        return []
    return ["for unit in model.modules():  # neither setter recurses: every FSDP unit",
            "    if isinstance(unit, FSDPModule):", *["        " + c for c in calls]]
