"""fsdp2: ``fully_shard`` on the case's units (children first, then the root),
with the options the case draws (reshard_after_forward, CPUOffloadPolicy,
MixedPrecisionPolicy, activation checkpointing, TP on the inner mesh dim,
gradient accumulation, a non-root forward, ``model.to`` after sharding,
compiled blocks or step); each rank trains on its slice of the batch."""
from __future__ import annotations

from ..case import Case
from ..kernel.model import tie_uses
from . import common, dsd, sync
from ..kernel.ac import AC_WRAPPED, ac_how
from .dtensor import SNAPSHOT
from .common import module  # (said in common.py: every writer names modules so)

KINDS = dsd.KINDS
AC_WRAPPERS = True  # its names read through a CheckpointWrapper (common.plain_names): every AC form written
LOOP = True  # its scripts write the training loop around the step (loop.py)
DTENSOR_GRADS = True  # its grads are DTensors: a total norm over them is one
SHARDED_SCALER = True  # its grad scaler is ShardedGradScaler (amp's where the case draws it), as the kernel's
FREEZE_BEFORE_SHARD = False
MOE = True  # it writes the case's MoE layers (common.py's MoE class), but not under TP
_OPTIONS = {"wrap", "reshard_after_forward", "offload", "mp", "ac", "ac_wrapper", "tp", "microbatches", "nonroot",
            "built_as", "compile", "compile_step", "tie_unit", "sync"}


DECODER_TP = True  # the decoder's TP plan written as torchtitan's apply_tp (without sequence or loss parallelism)


def _decoder_tp(case: Case, plan: dict) -> list[str]:
    """kernel/decoder.py parallelize_decoder (no sp, no loss_parallel: the activations replicated between the plan's
    elements): the embedding row-wise, the head column-wise, a block's attention (wq, wk, wv column-wise, wo
    row-wise) and MLP (w1, w3 column-wise, w2 row-wise), on the inner mesh dim."""
    top = {"tok_embeddings": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())",
           "output": "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)"}
    out = []
    chosen = {f: top[f] for f in top if f in plan}
    if chosen:
        out.append(f"parallelize_module(model, mesh[\"d1\"], {{{', '.join(f'{f!r}: {v}' for f, v in chosen.items())}}})"
                   "  # torchtitan's TP plan, on the inner dim")
    swiglu = case.model.sizes.get("mlp") == "swiglu"
    for name in sorted({f.split(".")[1] for f in plan if f.startswith("layers.")}, key=int):
        inner = []
        for part, style, col, row in (("attention", "heads", ("wq", "wk", "wv"), "wo"),
                                      ("feed_forward", "mlp", ("w1", "w3") if swiglu else ("w1",), "w2")):
            if plan.get(f"layers.{name}.{part}") == style:
                inner += [f"{part + '.' + w!r}: ColwiseParallel()" for w in col] + \
                    [f"{part + '.' + row!r}: RowwiseParallel(output_layouts=Replicate())"]
        if inner:
            out.append(f"parallelize_module(model.layers[{name!r}], mesh[\"d1\"], {{{', '.join(inner)}}})"
                       f"  # block {name}'s part of the plan")
    if case.model.sizes.get("tied") and "tok_embeddings" in plan:  # both Shard(0) of the vocabulary: one weight again
        out.append("model.output.weight = model.tok_embeddings.weight  # tied again after parallelize_module (torchtitan)")
    return out


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    if extra:
        return f"options {sorted(extra)}"
    if common.has_moe(case) and options.get("tp"):
        return "an MoE layer under TP (the layer sees DTensor activations: the kernel's MoE._forward_local)"
    if common.has_moe(case) and any(u.endswith("shared_experts") for u in options.get("wrap", ())):
        return "a shared expert with a fully_shard of its own (the script's shared expert has no forward)"
    return sync.unsupported(case, options)


def imports(case: Case, options: dict) -> list[str]:
    fsdp = ["fully_shard"] + ["FSDPModule"] * bool(sync.fsdp2_reduce_options(options) if options.get("sync") else 0) + \
        ["CPUOffloadPolicy"] * bool(options.get("offload")) + \
        ["MixedPrecisionPolicy"] * bool(options.get("mp"))
    out = ["from torch.distributed.device_mesh import init_device_mesh",
           f"from torch.distributed.fsdp import {', '.join(fsdp)}", "from torch.distributed.tensor import DTensor"]
    out += ["import types"] * bool(options.get("compile_step"))
    if options.get("tp") and case.model.factory == "decoder":  # torchtitan's plan (kernel/decoder.py)
        out += ["from torch.distributed.tensor import Replicate",
                "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module"]
    elif options.get("tp"):
        styles = sorted({"ColwiseParallel" if s == "colwise" else "RowwiseParallel" for s in options["tp"].values()})
        out += ["from torch.distributed.tensor import Replicate",
                f"from torch.distributed.tensor.parallel import {', '.join(styles)}, parallelize_module"]
    return out


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    out = [f"mesh = {mesh}"]
    dp = "mesh"
    if options.get("tp") and case.model.factory == "decoder":
        out += _decoder_tp(case, options["tp"])
        dp = "mesh[\"d0\"]"
    elif options.get("tp"):
        style = {"colwise": "ColwiseParallel(output_layouts=Replicate())",
                 "rowwise": "RowwiseParallel(input_layouts=Replicate())"}
        plan = ", ".join(f"{fqn!r}: {style[s]}" for fqn, s in options["tp"].items())
        out.append(f"parallelize_module(model, mesh[\"d1\"], {{{plan}}})  # TP on the inner dim")
        dp = "mesh[\"d0\"]"
    out += common.ac_lines(case, options)  # activation checkpointing before fully_shard, as the kernel
    if options.get("compile") == "before":
        out += ["for block in model.layers.children():", "    block.compile()"]
    kw = [f"mesh={dp}"]
    if options.get("reshard_after_forward", True) is not True:
        kw.append(f"reshard_after_forward={options['reshard_after_forward']!r}")
    if options.get("offload"):
        kw.append("offload_policy=CPUOffloadPolicy(pin_memory=False)")
    if options.get("mp"):
        mp = options["mp"]
        args = [f"{k}=torch.{mp[k]}" for k in ("param_dtype", "reduce_dtype", "output_dtype") if mp.get(k)]
        args += ["cast_forward_inputs=False"] * (not mp.get("cast_forward_inputs", True))
        kw.append(f"mp_policy=MixedPrecisionPolicy({', '.join(args)})")
    units = sorted(options.get("wrap", []), key=lambda n: (-n.count("."), n))  # children before parents
    out += [f"fully_shard({module(u, case)}, {', '.join(kw)})" for u in units]
    if options.get("tie_unit"):  # the tied weight's two modules in one unit of their own, as FSDP2 asks of shared params
        out.append(f"fully_shard([{', '.join(module(u, case) for u in tie_uses(case.model))}], {', '.join(kw)})")
    out.append(f"fully_shard(model, {', '.join(kw)})")
    if options.get("compile") == "after":
        out += ["for block in model.layers.children():", "    block.compile()"]
    if options.get("built_as"):
        out.append(f"model.to(torch.{case.dtype})  # built in {options['built_as']}, moved after fully_shard")
    if options.get("sync"):
        out += sync.fsdp2_reduce_options(options) + sync.weights_line(case, options)
    return out


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    names = common.plain_names() if ac_how(options) in AC_WRAPPED else "model.named_parameters()"
    out = common.optimizer(case, lr_scale, names=names)
    if options.get("compile_step"):
        out += ["eager = opt.step", "step = torch.compile(lambda: eager(), fullgraph=False)  # the step compiled",
                "opt.step = types.MethodType(lambda self, closure=None: step(), opt)  # a method (a scheduler wraps it)"]
    return out


def objective(case: Case, net: str, x: str) -> str:
    """The plain replay's loss as the kernel's objective says it (kernel/targets/fsdp2.py): plus the non-root
    forward's term (layers.0 called on the input) under ``nonroot``."""
    loss = common.loss(case, f"{net}({x})", "y")
    loss = f"({loss} + {net}.layers[0]({x}).square().mean())" if case.target_options.get("nonroot") else loss
    return sync.objective(case, net, x, loss) if case.target_options.get("sync") else loss


def global_loss(case: Case, world: int) -> list[str]:
    """The step's global loss for ReduceLROnPlateau: each rank's slice, the mean over the ranks, summed in
    float64 (as the kernel's)."""
    return ["full_loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().double()",
            "dist.all_reduce(full_loss)  # every rank of a data-parallel slice holds its loss: the mean over ranks",
            f"full_loss = float((full_loss / {world}).to(torch.{case.dtype}))"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    dp = shape[0] if options.get("tp") else world
    per = case.batch // dp
    r = f"rank // {shape[1]}" if options.get("tp") else "rank"
    out = [f"x, y = x[{per} * ({r}):{per} * ({r}) + {per}], y[{per} * ({r}):{per} * ({r}) + {per}]  # this rank's slice"
           if dp > 1 else "# one data-parallel rank: the whole batch"]
    loss = common.loss(case, "model(x)", "y") + (" + model.layers[0](x).square().mean()  # a non-root forward too"
                                              if options.get("nonroot") else "")
    m = options.get("microbatches", 1)
    if options.get("sync"):
        lm = common.loss(case, "model(xm)", "ym") + (" + model.layers[0](xm).square().mean()" if options.get("nonroot") else "")
        rows = f"{per} * ({r}):{per} * ({r}) + {per}" if dp > 1 else None
        return out + sync.loop(case, options, lambda last: sync.fsdp2_controls(options, last), lm, rows)
    if m > 1:
        xm = common.loss(case, "model(xm)", "ym") + loss[len(common.loss(case, "model(x)", "y")):].replace("(x)", "(xm)")
        return out + [f"for i, (xm, ym) in enumerate(zip(x.chunk({m}), y.chunk({m}))):  # grad accumulation",
                      f"    model.set_requires_gradient_sync(i == {m - 1})", f"    loss = {xm.split('  #')[0]}",
                      f"    (loss / {m}).backward()"]
    return out + [f"loss = {loss}", "loss.backward()"]


def snapshot(case: Case, options: dict) -> list[str] | None:
    if ac_how(options) in AC_WRAPPED:  # (plain names: a dict's items where the names were pairs)
        return [ln.replace("model.named_parameters()", common.plain_names() + ".items()") for ln in SNAPSHOT]
    return SNAPSHOT


def grads(case: Case, options: dict) -> str | None:
    pairs = common.plain_names() + ".items()" if ac_how(options) in AC_WRAPPED else "model.named_parameters()"
    return "{n: None if q.grad is None else q.grad.full_tensor().clone() for n, q in " + pairs + "}"
