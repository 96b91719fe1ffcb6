"""float8 training through torchao (an optional extra: ``pip install 'fuzzshard[ao]'``), for the fsdp2 target.

fsdp2's ``float8`` option: ``torchao.float8.convert_to_float8_training`` with one of the recipes torchao names
(``Float8LinearConfig.from_recipe_name``: tensorwise, rowwise, rowwise_with_gw_hp) over the drawn Linears
(``linears``, a module filter by FQN), before ``fully_shard``; with the tensorwise recipe FSDP2 may all-gather
the weights in float8 (``all_gather``: ``enable_fsdp_float8_all_gather``), their scales precomputed once a step
(``precompute``: ``precompute_float8_dynamic_scale_for_fsdp``), and ``recompute_bwd``
(``force_recompute_fp8_weight_in_bwd``). On CPU the float8 matmuls are emulated (``emulate=True``: the operands
are cast to float8 and back, then multiplied in high precision); on a GPU a Linear takes float8 only where
torchao's hardware rule holds (both dims multiples of 16: torchao's auto filter), else it stays high precision.

The reference (``reference``): the same float8 model unsharded, each data-parallel rank's slice run on its own
(an activation's and a grad's scale are taken over that rank's slice, as FSDP2's ranks take it), the grads
averaged exactly. The weight's scale is 448 / amax (e4m3's max over the weight's max |value|, in float64, then
float32) on both sides: with the float8 all-gather each rank's amax is all-reduced with MAX, and a max is exact
in any order, so each element is rounded to the same e4m3 value (3 mantissa bits: a rounding moves it by up to
2^-4 of itself) on both sides. What remains is the grads' reduction (``mixed_precision_tolerance`` with the
case's dtype for both) and kernel rounding upstream of a cast, which can move an element across an e4m3 rounding
boundary (one e4m3 spacing, 2^-3 of it): the one-ulp sensitivity measured on the float8 model bounds that, as it
does any rounding of a legitimate run (plain.sensitivity). A scale taken over one shard only is off by a factor
(amax_global / amax_local), far past both.

torchao is imported inside the functions (the module imports without it); names prefixed float8_: the
flattened kernel holds every module in one namespace.
"""
from __future__ import annotations

import importlib.util

from .model import param_shapes
from .oracles import mixed_precision_tolerance
from .plain import sensitivity

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# one line at session start where torchao is missing (cli/common.py)
FLOAT8_OFF = ("fuzzshard: torchao is not installed: --ao's draws (float8 training, low-bit optimizers) are off "
              "(pip install 'fuzzshard[ao]')")


def float8_available() -> bool:
    """torchao importable (found, not imported: importing it costs seconds)."""
    return importlib.util.find_spec("torchao") is not None


def draw_float8(draw, shapes: dict, tied: tuple = (), wrap=()) -> dict | None:
    """None (off, the simplest) one time in three; else a recipe, the Linears it converts (a nonempty subset
    of the 2-D weights' owners, tied ones left out), and the recipe's FSDP2 switches (all off first). Steered to
    the float8 all-gather (two float8 cases in three take it, and with it tensorwise; shrunk: off), and with it
    away from the FSDP2 units (of ``wrap``) gloo cannot all-gather (``float8_only_units``): their Linears stay high
    precision, or the all-gather is off where none would be left."""
    import hypothesis.strategies as st

    owners = [n.rsplit(".", 1)[0] for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2]
    owners = [o for o in owners if o not in tied and ".router." not in f".{o}."]  # (an MoE's gate: float8_problem)
    on = draw(st.sampled_from([False, True, True]))  # asked for (--ao): two in three (drawn first: a composite draws)
    if not owners or not on:
        return None
    gather = draw(st.sampled_from([False, True, True]))  # the float8 all-gather (torchao's: tensorwise only)
    recipe = "tensorwise" if gather else draw(st.sampled_from(FLOAT8_RECIPES))
    linears = [o for o in owners if draw(st.booleans())] or owners[:1]
    out = {"recipe": recipe, "linears": linears}
    if gather:
        out["all_gather"] = True
        if draw(st.booleans()):
            out["precompute"] = True
        bad = set(float8_only_units(shapes, wrap, linears))
        if bad:  # (gloo's refusal: the rule says so on CPU; on a GPU the case loses those Linears only)
            units = sorted({"", *wrap}, key=lambda u: -u.count(".") - 1 if u else 0)
            kept = [o for o in linears
                    if (next(u for u in units if not u or f"{o}.weight".startswith(u + ".")) or "(root)") not in bad]
            if kept and not float8_only_units(shapes, wrap, kept):
                out["linears"] = kept
            else:
                out.pop("all_gather"), out.pop("precompute", None)
    if draw(st.sampled_from([False, False, True])):
        out["recompute_bwd"] = True
    return out


def draw_float8_tp(draw, plan: dict, model, shapes: dict) -> dict | None:
    """The tp target's float8 (--ao): None half the time; else tensorwise float8 on a nonempty subset of the plan's
    bias-free Linears, which take torchao's Float8ColwiseParallel / Float8RowwiseParallel (torchao's float8 TP
    styles cast with dynamic tensorwise scales only). A Linear with a bias is drawn too: those styles cast its
    output's grad to e5m2 before the bias's grad reads it, a known torchao bug (root cause
    torchao-float8-tp-bias-grad-e5m2, docs/ao/float8_tp_bias_grad.py)."""
    import hypothesis.strategies as st

    on = draw(st.booleans())
    owners = sorted(f for f in plan if not (f == "layers.0" and model.input == "tokens"))  # (an Embedding)
    if not on or not owners or model.factory:
        return None
    linears = [o for o in owners if draw(st.booleans())] or owners[:1]
    out = {"recipe": "tensorwise", "linears": linears}
    if draw(st.sampled_from([False, False, True])):
        out["recompute_bwd"] = True
    return out


# the decoder's TP plan elements torchao's float8 styles take, with their Linears (the column-wise first: the one
# whose forward config PrepareFloat8ModuleInput casts with) and the row-wise one
FLOAT8_DECODER_PARTS = {"attention": (("wq", "wk", "wv"), "wo"), "feed_forward": (("w1", "w3"), "w2")}


def float8_decoder_linears(plan: dict, shapes: dict, parts) -> list[str]:
    """The Linears of the plan's sharded attention / MLP elements of kinds ``parts``, by FQN."""
    out = []
    for element in sorted(plan):
        part = element.rsplit(".", 1)[-1]
        if part in parts and element.startswith("layers."):
            col, row = FLOAT8_DECODER_PARTS[part]
            out += [f"{element}.{w}" for w in (*col, row) if f"{element}.{w}.weight" in shapes]
    return out


def draw_float8_decoder_tp(draw, options: dict, shapes: dict) -> dict | None:
    """The tp target's float8 on the decoder (--ao), as torchtitan's float8 TP plan: None half the time; else
    tensorwise float8 on every Linear of the sharded attention and / or MLP elements (the same kinds in every block),
    which take Float8ColwiseParallel / Float8RowwiseParallel, and (``prepare_input``) a PrepareFloat8ModuleInput in
    front of each, casting the element's input to float8 once for its column-wise Linears. Without sequence
    parallelism only: under it that module all-gathers the sequence in float8, which gloo refuses (a backend limit,
    docs/ao/gloo_float8_all_gather_invalid_scalar_type.json); NCCL takes it."""
    import hypothesis.strategies as st

    on = draw(st.booleans())
    plan = options.get("tp") or {}
    kinds = sorted({e.rsplit(".", 1)[-1] for e in plan if e.startswith("layers.")} & set(FLOAT8_DECODER_PARTS))
    if not on or not kinds:
        return None
    parts = [k for k in kinds if draw(st.booleans())] or kinds[:1]
    out = {"recipe": "tensorwise", "linears": float8_decoder_linears(plan, shapes, parts)}
    if not options.get("sp") and draw(st.booleans()):
        out["prepare_input"] = True
    if draw(st.sampled_from([False, False, True])):
        out["recompute_bwd"] = True
    return out


def float8_decoder_problem(case, options: dict, f8: dict) -> str | None:
    """What the decoder's float8 under TP cannot be: whole sharded elements (PrepareFloat8ModuleInput's float8
    input reaches each of the element's Linears), and its float8 all-gather not on gloo."""
    plan = options.get("tp") or {}
    shapes = param_shapes(case.model)
    parts = {fqn.split(".")[2] for fqn in f8.get("linears", ()) if fqn.startswith("layers.") and fqn.count(".") == 3}
    if not parts or set(f8["linears"]) != set(float8_decoder_linears(plan, shapes, parts)):
        return ("float8 under the decoder's TP: every Linear of the plan's sharded attention and / or MLP elements "
                "of each kind drawn")
    if f8.get("prepare_input") and options.get("sp") and case.device == "cpu":
        return ("float8 PrepareFloat8ModuleInput under sequence parallelism: it all-gathers the sequence in float8, "
                "which gloo refuses (set apart)")
    return None


def float8_tp_problem(case, options: dict) -> str | None:
    """What the tp target's float8 option cannot be (its check)."""
    f8 = options.get("float8")
    if not f8:
        return None
    if not float8_available():
        return "float8 needs torchao (pip install 'fuzzshard[ao]')"
    if f8.get("recipe") != "tensorwise" or f8.get("all_gather") or f8.get("precompute"):
        return "float8 under TP: torchao's Float8ColwiseParallel / Float8RowwiseParallel take the tensorwise recipe"
    plan = options.get("tp") or {}
    if case.model.factory == "decoder":
        problem = float8_decoder_problem(case, options, f8)
        if problem:
            return problem
    elif f8.get("prepare_input"):
        return "float8 PrepareFloat8ModuleInput: in front of the decoder's attention and MLP elements"
    elif case.model.factory or set(f8.get("linears", ())) - set(plan):
        return "float8 under TP: on Linears the plan parallelizes, of a drawn topology or the decoder"
    # a Linear narrower than the TP degree (a rank's empty shard fails torchao's amax: torch.max of a DTensor with an
    # empty local shard, root cause dtensor-max-empty-local-shard) and a Linear with a bias (its grad read from the
    # e5m2-rounded output grad, torchao-float8-tp-bias-grad-e5m2) are drawn: known bugs (fuzzshard/known/)
    from .dropout import has_dropout
    from .moe import moe_configs_of

    if has_dropout(case.model):
        return "float8 with dropout: its reference does not replay the ranks' masks"
    if moe_configs_of(case.model):  # (met by the 10-minute --ao session: expert_bias from the reference's own routing)
        return "float8 with an MoE layer: its reference does not replay the routing counts (not drawn yet)"
    if case.checkpoint:
        return "float8 with a checkpoint: not drawn yet"
    if case.dtype != "float32":
        return "float8 training takes float32 high-precision weights here"
    return None


def float8_problem(case, mesh: tuple, options: dict) -> str | None:
    """What a float8 option cannot be (Case.check, through fsdp2's check)."""
    f8 = options.get("float8")
    if not f8:
        return None
    if not float8_available():
        return "float8 needs torchao (pip install 'fuzzshard[ao]')"
    if options.get("sync"):
        return "float8 with gradient-sync controls: its reference runs each rank's slice as plain microbatches do"
    from .dropout import has_dropout

    if has_dropout(case.model):
        return "float8 with dropout: its reference does not replay the ranks' masks"
    from .moe import moe_configs_of

    if moe_configs_of(case.model):  # (float8_reference keeps no routing counts: the expert bias is the reference's own)
        return "float8 with an MoE layer: its reference does not replay the routing counts (not drawn yet)"
    if any(".router." in f".{o}." for o in f8.get("linears", ())):
        return "float8 on an MoE router's gate: a float8 cast decides the routing"
    if f8.get("recipe") not in FLOAT8_RECIPES:
        return f"float8 recipe {f8.get('recipe')!r}: want one of {', '.join(FLOAT8_RECIPES)}"
    if f8.get("all_gather") and f8["recipe"] != "tensorwise":
        return "float8 all-gather: torchao takes it with the tensorwise recipe only"
    shapes = param_shapes(case.model)
    # an uneven float8 all-gather (torchao sends the shard unpadded: root cause torchao-float8-uneven-all-gather), an
    # empty shard's amax (torchao-float8-fsdp-amax-empty-shard) and, with precompute, an empty shard's inf norm
    # (dtensor-inf-norm-empty-local-shard) are drawn: known bugs (fuzzshard/known/)
    if f8.get("all_gather") and case.device == "cpu":
        # FSDP2 all-gathers a unit's inputs in their dtype where they share one (else as uint8 bytes): a unit
        # holding only float8 weights all-gathers float8, which gloo refuses ("RuntimeError: Invalid scalar
        # type"; NCCL takes it). A backend limit, kept (docs/ao/gloo_float8_all_gather_invalid_scalar_type.json)
        units = float8_only_units(shapes, options.get("wrap", ()), f8["linears"])
        if units:
            return (f"float8 all-gather on gloo of FSDP2 unit(s) {units} holding float8 weights only: gloo takes no "
                    "float8 dtype (set apart)")
    if f8.get("precompute") and not f8.get("all_gather"):
        return "float8 precompute: the scales precomputed are the float8 all-gather's"
    for other in ("tp", "mp", "built_as", "compile", "compile_step"):
        if options.get(other):
            return f"float8 with {other}: not drawn yet (its reference does not replay both)"
    if case.checkpoint:
        return "float8 with a checkpoint: not drawn yet"
    if case.dtype != "float32":
        return "float8 training takes float32 high-precision weights here"
    return None


def float8_only_units(shapes: dict, wrap, linears) -> list[str]:
    """The FSDP2 units (each wrapped FQN, "" the root) whose own params (those not under a deeper unit) are all
    weights of converted Linears."""
    units = sorted({"", *wrap}, key=lambda u: -u.count(".") - 1 if u else 0)  # deepest first, the root last
    own = {u: [] for u in units}
    for name in shapes:
        owner = next(u for u in units if not u or name.startswith(u + "."))  # the deepest unit holding it
        own[owner].append(name)
    weights = {f"{fqn}.weight" for fqn in linears}
    return [u or "(root)" for u in units if own[u] and all(n in weights for n in own[u])]


def float8_config(f8: dict, emulate: bool):
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    c = Float8LinearConfig.from_recipe_name(f8["recipe"])
    return dataclasses.replace(c, emulate=emulate, enable_fsdp_float8_all_gather=bool(f8.get("all_gather")),
                               force_recompute_fp8_weight_in_bwd=bool(f8.get("recompute_bwd")))


def float8_convert(model, f8: dict, device: str, all_gather: bool = True):
    """``convert_to_float8_training`` in place on the drawn Linears (emulated on CPU; on a GPU the Linears that
    break torchao's multiples-of-16 rule stay high precision). ``all_gather`` False: the reference's copy."""
    import warnings

    import torch.nn as nn
    from torchao.float8 import convert_to_float8_training

    emulate = device == "cpu"
    chosen = set(f8["linears"])

    def keep(mod, fqn):
        return (fqn in chosen and isinstance(mod, nn.Linear)
                and (emulate or (mod.in_features % 16 == 0 and mod.out_features % 16 == 0)))

    with warnings.catch_warnings():  # force_recompute_fp8_weight_in_bwd: torchao warns it is deprecated
        warnings.simplefilter("ignore")
        cfg = float8_config({**f8, "all_gather": f8.get("all_gather") and all_gather}, emulate)
        return convert_to_float8_training(model, config=cfg, module_filter_fn=keep)


def float8_precompute(model, f8: dict) -> None:
    """``precompute_float8_dynamic_scale_for_fsdp``: once a step, before the forward (after the step before)."""
    if f8.get("precompute"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def float8_reference(case, model, options: dict, world: int, x, y, objective, scale: float = 1.0) -> tuple:
    """The same float8 model unsharded: a float8 copy of ``model`` runs each data-parallel rank's slice (in its
    microbatches, loss / m each, the grads added as FSDP2 accumulates them), and the W ranks' grads are averaged
    in float64. Returns (loss, grads, tolerance, sensitivity, elementwise allowance), as fsdp2's
    mixed_precision_reference does."""
    import copy
    import functools

    import torch


    f8 = options["float8"]
    low = float8_convert(copy.deepcopy(model), f8, str(x.device.type), all_gather=False)
    params = dict(low.named_parameters())
    per, m = x.shape[0] // world, options.get("microbatches", 1)
    loss, total, spread, sens = 0.0, {}, {}, {}
    for r in range(world):
        acc = {}
        for xm, ym in zip(x[r * per:(r + 1) * per].chunk(m), y[r * per:(r + 1) * per].chunk(m)):
            for key, v in sensitivity(low, params, xm, ym, functools.partial(objective, options=options),
                                      1.0 / m).items():
                sens[key] = sens.get(key, 0.0) + v / world
            for p in params.values():
                p.grad = None
            local = objective(low, xm, ym, options) / m
            (local if scale == 1.0 else local * scale).backward()
            loss += local.detach().double() / world
            for n, p in params.items():
                if p.grad is not None:
                    acc[n] = acc[n] + p.grad if n in acc else p.grad.clone()
                    spread[n] = spread.get(n, 0) + p.grad.double().abs() / scale
        for n, g in acc.items():
            total[n] = total.get(n, 0) + g.double()
    tol = dict(mixed_precision_tolerance(case.dtype, case.dtype, world, m))
    tol["why"] = ("float8 (torchao " + f8["recipe"] + "): the same e4m3 casts with the same scales on both sides "
                  "(an amax is a max: exact in any order), so " + tol["why"].removeprefix("mixed precision: ")
                  + "; an e4m3 rounding (3 mantissa bits) moved across a boundary by upstream kernel rounding is "
                  "within the one-ulp sensitivity measured on the float8 model")
    dtype = getattr(torch, case.dtype)
    grads = {}
    for n, p in model.named_parameters():
        new = (total[n] / world).to(dtype) * (1.0 if scale == 1.0 else 1.0 / scale) if n in total else None
        grads[n] = p.grad if new is None else new if p.grad is None else p.grad + new
    extra = {n: tol["k_ulps"] * tol["u"] * spread[n] / world for n in spread}
    return loss.to(dtype), grads, tol, sens, extra
