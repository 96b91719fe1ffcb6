"""fsdp2's draws and rules (kernel/targets/fsdp2.py's target adapter uses them; tp's plan draws and rules too):
what a case draws, what it cannot be, how it fits a reduced mesh, its facts and coverage."""
from __future__ import annotations

import dataclasses

from .dropout import has_dropout
from .float8 import draw_float8, float8_problem
from .lowbit import lowbit_problem
from .model import param_shapes, tie_uses, tied_modules
from .moe import moe_prefixes
from .sync import draw_sync, sync_cells, sync_problem


def draw_options(draw, shapes: dict, mesh_shape: tuple, tied: tuple = (), **context) -> dict:
    """Which submodules get their own fully_shard (the root always does), and
    reshard_after_forward (True, False, or an int dividing the shard group).
    A module holding a tied param stays in the root's group, as FSDP2 documents
    (wrapping it alone is rejected with a clear error: an invalid config)."""
    import hypothesis.strategies as st

    owners = sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})
    # on a 2-D mesh: HSDP (replicate x shard), or TP on the inner dim + FSDP2 on the outer
    # the decoder is drawn for its TP plan: three in four of its 2-D meshes get one (shrinking: none, HSDP)
    model = context["model"]
    decoder = model.factory == "decoder"
    tp, layouts = {}, {}  # the plan, and the decoder's sp / loss_parallel
    if len(mesh_shape) == 2 and draw(st.sampled_from([False, True, True, True]) if decoder else st.booleans()):
        if decoder:
            layouts = draw(st.composite(draw_decoder_tp)(model.sizes, mesh_shape[-1]))
            tp = layouts.pop("tp")
        else:
            tp = draw(st.composite(draw_tp_plan)(shapes, tied, model))
    wrap = [m for m in owners if m not in tied and draw(st.booleans())]
    shard = mesh_shape[0] if tp else mesh_shape[-1]
    raf = draw(st.sampled_from([True, False] + [d for d in range(2, shard) if shard % d == 0]))
    out = {"wrap": wrap, "reshard_after_forward": raf}
    if tp:
        out["tp"] = tp
        out.update(layouts)
    # extras, drawn off first so a shrunk case drops them
    if draw(st.booleans()):
        out["offload"] = True  # CPUOffloadPolicy(pin_memory=False)
    ac = [m for m in owners if draw(st.sampled_from([False, False, True]))]
    if ac:
        out["ac"] = ac  # activation checkpointing, applied before fully_shard: composable
        if draw(st.booleans()):
            out["ac_wrapper"] = True  # or apply_activation_checkpointing's CheckpointWrapper
    microbatches = draw(st.sampled_from([1, 1, 2, 3]))
    if microbatches > 1:
        out["microbatches"] = microbatches  # grad accumulation, no sync on all but the last
    if not tp and draw(st.sampled_from([False, False, True])):
        # (not with TP: its low-precision partial sums are not replayed yet)
        out["mp"] = draw(st.composite(draw_mp_policy)())
    if context.get("ao") and not tp and "mp" not in out:  # --ao: torchao's float8 Linears (kernel/float8.py)
        f8 = draw(st.composite(draw_float8)(shapes, tied, out.get("wrap", ())))
        if f8:
            out["float8"] = f8
    if context.get("compile"):  # --compile: each block compiled, before fully_shard (torchtitan's order) or after
        out["compile"] = draw(st.sampled_from(["before", "after"]))
        if draw(st.booleans()):
            out["compile_step"] = True  # and the optimizer step
    if tie_uses(model) and draw(st.booleans()):  # drawn last: an untied case's draws stay as they were
        out["tie_unit"] = True  # the tie's two modules in one unit of their own: fully_shard([embedding, head])
    return out


def draw_tp_plan(draw, shapes: dict, tied: tuple, model) -> dict:
    """A TP style per Linear (colwise or rowwise, or none) and for the input
    Embedding (colwise or none; row-wise Embedding sharding is the dtensor
    target's); a module holding a tied param keeps it whole. The decoder
    transformer gets torchtitan's plan instead: ``draw_decoder_tp``."""
    import hypothesis.strategies as st

    plan = {}
    inside = moe_prefixes(model)  # an MoE layer stays whole (its router and shared expert included)
    for name, shape in shapes.items():
        fqn = name.rsplit(".", 1)[0]
        if not name.endswith(".weight") or len(shape) != 2 or fqn in tied or fqn.startswith(inside):
            continue
        embedding = fqn == "layers.0" and model.input == "tokens"
        style = draw(st.sampled_from([None, "colwise"] if embedding else [None, "colwise", "rowwise"]))
        if style:
            plan[fqn] = style
    return plan


def draw_decoder_tp(draw, sizes: dict, tp: int) -> dict:
    """torchtitan's TP plan, drawn per element (decoder.TP_STYLES): the
    embedding row-wise, the blocks' attention (where the query and KV head
    counts divide by the TP degree, as torchtitan requires) and MLP, the
    output head; sequence parallelism (``sp``: the norms too, the elements
    left whole gather and scatter the sequence around them), and
    ``loss_parallel`` where the head is sharded. A tied embedding and head stay
    whole. Returns {"tp": plan} plus "sp" / "loss_parallel" when set."""
    import hypothesis.strategies as st

    heads = sizes["n_heads"] % tp == 0 and sizes["n_kv_heads"] % tp == 0
    # w1's column-wise output goes into w2's row-wise input as a local tensor, which RowwiseParallel reads
    # as an even shard (DTensor.from_local without a shape): an uneven MLP width raises (a recorded torch
    # finding, tp-rowwise-local-input-assumes-even). Drawn rarely, so it stays covered without costing cases
    # an MoE in place of the MLP stays whole (no expert TP)
    mlp = not sizes.get("moe") and (sizes["hidden"] % tp == 0 or draw(st.integers(0, 7)) == 7)
    sp = draw(st.booleans())
    often = st.sampled_from([False, True, True, True])  # each element three times in four (shrinks to left whole)
    plan = {}
    # a tied embedding and head are sharded together or not at all (vocab_tie below): the vocabulary-parallel
    # embedding (row-wise, Shard(0)) and the column-wise head (Shard(0) too) share one DTensor weight
    vocab_tie = sizes["tied"] and draw(often)
    if vocab_tie or (not sizes["tied"] and draw(often)):
        plan["tok_embeddings"] = "rowwise"
    # one plan for every block, as torchtitan's (and a block count that shrinks without moving the draws after it)
    attention, feed_forward = heads and draw(often), mlp and draw(often)
    for i in range(sizes["n_layers"]):
        if attention:
            plan[f"layers.{i}.attention"] = "heads"
        if feed_forward:
            plan[f"layers.{i}.feed_forward"] = "mlp"
    if vocab_tie or (not sizes["tied"] and draw(often)):
        plan["output"] = "colwise"
    out = {"tp": plan}
    if sp:
        out["sp"] = True
    if "output" in plan and draw(st.booleans()):
        out["loss_parallel"] = True
    return out


def draw_late_options(draw, case) -> dict:
    """Now and then a model built in the other float dtype and moved to the
    case's with model.to() after fully_shard (``built_as``); with layers.0 of
    a drawn topology wrapped on its own, half the time a forward of it from
    outside the root's (``nonroot``, adds to the loss: see ``objective``)."""
    import hypothesis.strategies as st

    out = dict(case.target_options)
    if draw(st.integers(0, 3)) == 3 and not out.get("float8"):
        out["built_as"] = "float64" if case.dtype == "float32" else "float32"
    if not case.model.factory and "layers.0" in out.get("wrap", ()) and draw(st.booleans()):
        out["nonroot"] = True
    sync = draw_sync(draw, dataclasses.replace(case, target_options=out), fsdp2=True)  # kernel/sync.py
    if sync:
        out["sync"] = sync
    return out


def coverage(case) -> dict:
    """A decoder case's share of the TP plan: its elements' styles (heads, mlp,
    the embedding rowwise, the head colwise), sp, loss_parallel, a checkpoint;
    "no TP" without a plan. A float8 case's recipe and switches (--ao). Any case's training loop features (fsdp1.loop_coverage),
    apart under mixed precision and gradient accumulation."""
    from .targets.fsdp1 import loop_coverage

    opts = case.target_options
    loop = loop_coverage(case, "mixed precision" if opts.get("mp") else "microbatches" if opts.get("microbatches")
                         else "")
    sync = {"gradient sync": sync_cells(opts)} if opts.get("sync") else {}
    f8 = opts.get("float8")
    if f8:  # --ao: torchao's recipes and FSDP2 switches that passed
        loop = {"float8 cases (torchao)": {f8["recipe"], *(k for k in ("all_gather", "precompute", "recompute_bwd")
                                                              if f8.get(k))}, **loop}
    if case.model.factory != "decoder":
        return {**loop, **sync}
    cells = {"cases"} | set((opts.get("tp") or {}).values()) | {k for k in ("sp", "loss_parallel") if opts.get(k)}
    if not opts.get("tp"):
        cells.add("no TP")
    if case.checkpoint:
        cells.add("checkpoint")
    return {"decoder cases by TP plan element": cells, **loop, **sync}


def draw_mp_policy(draw) -> dict:
    """A MixedPrecisionPolicy for every unit: compute (param) dtype, reduce
    dtype, output dtype and cast_forward_inputs."""
    import hypothesis.strategies as st

    return {"param_dtype": draw(st.sampled_from([None, "bfloat16", "float16"])),
            "reduce_dtype": draw(st.sampled_from([None, "float32", "bfloat16", "float16"])),
            "output_dtype": draw(st.sampled_from([None, "float32"])),
            # off, float inputs meet low-precision params: a dtype error on both sides (invalid)
            "cast_forward_inputs": draw(st.sampled_from([True, True, True, False]))}


def check(case) -> str | None:
    """What FSDP2's options cannot be, on either side of a checkpoint."""
    sides = [("", case.mesh_shape, case.target_options)]
    if case.checkpoint:
        sides.append(("checkpoint ", case.checkpoint.mesh_shape, case.checkpoint.target_options))
    for what, mesh, options in sides:
        if options.get("built_as", "float32") not in ("float32", "float64"):
            return f"{what}built_as {options['built_as']!r}: want float32 or float64"
        if options.get("tie_unit") and not tie_uses(case.model):
            return f"{what}tie_unit puts a tied param's two modules in one unit: the model has no tie"
        if options.get("nonroot") and "layers.0" not in options.get("wrap", ()):
            return f"{what}nonroot calls layers.0 from outside the root: it needs its own fully_shard (wrap)"
        if options.get("tp") and len(mesh) != 2:
            return f"{what}tensor parallel needs a 2-D mesh (data parallel x TP), not {list(mesh)}"
        problem = (tp_problem(case, mesh, options) or sync_problem(case, mesh, options, fsdp2=True)
                   or float8_problem(case, mesh, options) or lowbit_problem(case, mesh, options))
        if problem:
            return what + problem
        if has_dropout(case.model) and (options.get("tp") or options.get("compile")):
            # TP's activations are sharded over the TP dim (masks on DTensors or local shards: no promise on CPU,
            # kernel/dropout.py); a compiled block draws its masks from Inductor's own generator, not eager's
            return (f"{what}dropout under {'tensor parallel' if options.get('tp') else 'torch.compile'}: "
                    f"its masks are not the unsharded eager model's by design")
    return None


def tp_problem(case, mesh: tuple, options: dict) -> str | None:
    """What a TP plan (``tp``, ``sp``, ``loss_parallel``; the TP degree is the mesh's last dim) cannot be."""
    plan = options.get("tp") or {}
    tied = sorted(set(plan) & set(tied_modules(case.model)))
    vocab_tie = case.model.factory == "decoder" and plan.get("tok_embeddings") == "rowwise" \
        and plan.get("output") == "colwise"
    if tied and not vocab_tie:  # one owner a DTensor, the other the old param or another layout: no shared weight
        return (f"tensor parallel on {tied}, which own a tied param: only a decoder's embedding row-wise with its "
                "head column-wise (both Shard(0) of the shared weight, re-tied after parallelize_module) keeps the tie")
    if (options.get("sp") or options.get("loss_parallel")) and case.model.factory != "decoder":
        return "sp and loss_parallel are the decoder transformer's TP plan options"
    if case.seq % seq_multiple(options, mesh):
        return f"sequence parallelism shards the sequence ({case.seq}) over the TP degree ({mesh[-1]}): " \
               "it must divide (torchtitan's rule)"
    if options.get("loss_parallel") and (options.get("tp") or {}).get("output") != "colwise":
        return "loss_parallel needs the output head column-wise"
    return None


def fit_options(options: dict, mesh_shape: list, n_steps: int) -> dict:
    """reshard_after_forward as an int divides the shard group (the outer
    mesh dim under TP, else the inner one): True where it no longer does."""
    raf, shard = options.get("reshard_after_forward"), mesh_shape[0] if options.get("tp") else mesh_shape[-1]
    if type(raf) is int and not (1 < raf < shard and shard % raf == 0):
        options["reshard_after_forward"] = True
    from .sync import fit

    return fit(options, mesh_shape)


def seq_multiple(options: dict, mesh_shape: tuple) -> int:
    """Sequence parallelism shards the sequence over the TP ranks: its length is a multiple of the TP degree."""
    return mesh_shape[-1] if options.get("sp") else 1


def facts(case) -> dict:
    """``tp_empty_shard``: some TP-split param dim is narrower than the TP
    degree, so a TP rank holds an empty shard (a root cause torch fails on in
    several ways, some of them hangs). ``sync_divide_twice``: kernel/sync.py divide_twice."""
    shapes = param_shapes(case.model)
    sides = [(case.mesh_shape, case.target_options)]
    if case.checkpoint:
        sides.append((case.checkpoint.mesh_shape, case.checkpoint.target_options))
    empty = False
    for mesh, options in sides:
        if case.model.factory == "decoder":  # the heads divide the degree: the vocabulary or the MLP may not
            sizes = case.model.sizes
            width = {"rowwise": sizes["d_in"], "colwise": sizes["d_in"], "mlp": sizes["hidden"]}
            empty |= any(width.get(style, mesh[-1]) < mesh[-1] for style in (options.get("tp") or {}).values())
            continue
        for fqn, style in (options.get("tp") or {}).items():
            shape = shapes.get(f"{fqn}.weight")
            embedding = fqn == "layers.0" and case.model.input == "tokens"
            # colwise splits a Linear's out-features (weight dim 0), an Embedding's dim (1); rowwise in-features (1)
            if shape and len(mesh) == 2 and shape[1 if style == "rowwise" or embedding else 0] < mesh[1]:
                empty = True
    from .sync import divide_twice

    return {"tp_empty_shard": empty, "sync_divide_twice": any(divide_twice(case, m, o) for m, o in sides)}
