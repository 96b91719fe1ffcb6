"""Make a failing case 1-minimal: no single structural edit of it keeps the bug.

Hypothesis shrinks along its draws; this reducer edits the Case itself, in
ways the draws cannot, the biggest steps first: drop a whole feature (the
checkpoint, its async save, the grad scaler, an overflow step, the LR
scheduler, the clipping), fewer ranks, the plainest lr, then drop a layer in
the middle (re-fitting the widths and renaming every FQN that names a later
layer), merge param groups, lower the world size on one side of a
checkpoint, drop one target option, ...

    r = minimize(case, lambda c: judge(pool, c).label == sig, budget_s=60)
    r.case, r.kept, r.minimal           # reduce(...) gives (r.case, r.kept)

``edits(case)`` lists every single edit that is still a well-formed case and
smaller by ``size()``; ``minimize`` keeps an edit that keeps the bug and goes
on from it, to a fixed point, and says whether it got there (``Reduction``:
1-minimal, or how many edits were left untried when its budget ran out). The
edits work on ``case.to_dict()``; each pass of them (EDITS, as Hypothesis
registers shrink passes) is a generator in this module, shrink_model.py (the
model) or shrink_world.py (the world, mesh, batch). ``passes`` runs some of
them alone: a simulated finding's least world is ``minimize(...,
passes=WORLD)`` (onset.least_worlds), the same edits the session's reducer
tries, one shrinker.
"""
from __future__ import annotations

import copy
import inspect
import json
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from ..case import Case
from ..kernel.model import param_shapes
from .edit import Edit, changed_copy
from .shrink_model import decoder_edits, layer_details, layer_drops, model_flags, modules
from .shrink_world import fit_options, size_edits, world_edits

# optimizer kwargs left alone: lr is the step itself, foreach/fused the implementation (a dimension of its own)
KEEP_KWARGS = ("lr", "foreach", "fused")
TENSOR_LR = ("", "0d", "1d")  # an lr from plainest to least plain: a float, a 0-d tensor, a 1-element tensor



@dataclass
class Reduction:
    """What a reduction did: the smallest case, the edits kept, and whether it got to the end.
    ``minimal``: every single edit of ``case`` was judged on it and none kept the bug (1-minimal);
    else the budget ran out (or the caller stopped it) with ``untried`` edits of ``case`` not judged on it."""
    case: Case
    kept: list[str]
    minimal: bool
    seconds: float
    runs: int  # edited cases judged
    untried: int = 0
    budget: float | None = None

    def record(self) -> dict:
        """The finding file's ``reduction``: what its "1-minimal" line says (cli/fuzz.py)."""
        out = {"minimal": self.minimal, "seconds": round(self.seconds, 1), "runs": self.runs}
        if not self.minimal:
            out.update(untried=self.untried, budget=None if self.budget is None else round(self.budget, 1))
        return out


def reduce(case: Case, keeps_bug: Callable[[Case], bool] | None = None, budget_s: float | None = None,
           on_smaller: Callable[[Case], None] | None = None,
           keeps_bugs: Callable[[list[Case]], list[bool]] | None = None, batch: int = 1) -> tuple[Case, list[str]]:
    """``minimize``'s (the smallest case, the edits kept)."""
    r = minimize(case, keeps_bug, budget_s, on_smaller, keeps_bugs, batch)
    return r.case, r.kept


def minimize(case: Case, keeps_bug: Callable[[Case], bool] | None = None, budget_s: float | None = None,
             on_smaller: Callable[[Case], None] | None = None,
             keeps_bugs: Callable[[list[Case]], list[bool]] | None = None, batch: int = 1,
             stop: Callable[[], bool] | None = None, passes: tuple | None = None) -> Reduction:
    """Greedy, to a fixed point: keep an edit of the current case for which
    ``keeps_bug`` holds and go on from it; stop when no edit keeps the bug
    (1-minimal) or the budget is spent (or ``stop()`` says so). ``on_smaller``
    sees each smaller case as it is found. ``keeps_bugs``: judges ``batch``
    edits at once (side by side on a pool); the first of them that keeps the
    bug is kept, as one at a time would.

    A pass goes down the edits once: after an edit is kept, the edits of the
    new case that an earlier one of the same pass did not keep (by what they
    do) wait for the next pass, so a pass costs about one run per edit, not
    one per edit per edit kept; the reduction ends after a pass that kept
    nothing, every edit of its case judged on that case. ``passes``: these
    of EDITS only (WORLD: the world edits), in their order; all by default."""
    judge = keeps_bugs or (lambda cases: [keeps_bug(c) for c in cases])
    started = time.monotonic()
    deadline = None if budget_s is None else started + budget_s
    batch = max(1, batch)
    kept: list[str] = []
    runs = 0
    failed: set[str] = set()  # edits (by what they do) this pass judged and the bug did not keep
    changed = False  # an edit was kept since ``failed`` was emptied: its entries were judged on an earlier case
    tried: set[str] = set()  # edits judged on the current case

    def out(minimal: bool) -> Reduction:
        seconds = time.monotonic() - started
        untried = 0 if minimal else len({what for what, _ in edits(case, passes)} - tried)
        return Reduction(case, kept, minimal, seconds, runs, untried, budget_s)

    while True:
        todo = [(what, c) for what, c in edits(case, passes) if what not in failed]
        hit = None
        for at in range(0, len(todo), batch):
            if (deadline is not None and time.monotonic() >= deadline) or (stop is not None and stop()):
                return out(False)
            chunk = todo[at:at + batch]
            oks = judge([c for _, c in chunk])
            runs += len(chunk)
            for (what, c), ok in zip(chunk, oks):
                if ok and hit is None:
                    hit = (what, c)
                elif not ok:
                    failed.add(what)
                    tried.add(what)
            if hit is not None:
                break
        if hit is not None:
            kept.append(hit[0])
            case, changed, tried = hit[1], True, set()
            if on_smaller:
                on_smaller(case)
            continue
        if not changed:  # a whole pass over this case's edits, none kept: 1-minimal
            return out(True)
        failed, changed = set(tried), False  # the edits skipped since the last one kept: judged on this case now


def edits(case: Case, passes: tuple | None = None) -> list[tuple[str, Case]]:
    """Every single structural edit of ``case`` that is a well-formed case and
    smaller (``size``), simplest and most-removing first, each with a short
    description ("drop layer layers.2", "world size 3 -> 2", ...); ``passes``:
    of these passes of EDITS only."""
    data, before = case.to_dict(), size(case)
    out, seen = [], {case.to_json()}
    for make in EDITS if passes is None else passes:
        for what, edited_data in make(data):
            edited = _well_formed(edited_data)
            if edited is None or size(edited) >= before:
                continue
            key = edited.to_json()
            if key not in seen:
                seen.add(key)
                out.append((what, edited))
    return out


def size(case: Case) -> tuple:
    """How big a case is, compared as a tuple: every edit makes it smaller,
    so a reduction ends. Ranks first, then the structure (layers, params,
    steps, groups), then the finer things (FQNs named, options, batch, widths)."""
    ck, model = case.checkpoint, case.model
    sides = [(case.world_size, case.mesh_shape)] + ([(ck.world_size, ck.mesh_shape)] if ck else [])
    shapes = param_shapes(model)
    structure = (_count_layers(model.layers) + model.tie_head + model.unused + model.buffer
                 + model.sizes.get("n_layers", 0) + bool(model.sizes.get("tied")) + bool(model.sizes.get("dropout")))
    mentions = (len(case.frozen) + sum(len(s.freeze) + len(s.unfreeze) for s in case.schedule)
                + (len(ck.missing) if ck else 0))
    options = _count(case.target_options) + (_count(ck.target_options) if ck else 0)
    ck_extras = (ck.split + (not ck.strict) + ck.unexpected + (ck.target_options != case.target_options)
                 + bool(ck.async_save) + (ck.async_save not in ("", "thread"))) if ck else 0
    optim = case.optim
    extras = (len(optim.kwargs) + TENSOR_LR.index(optim.tensor_lr) + optim.named + optim.added_groups + optim.added_at
              + sum(len(g.overrides) for g in case.groups) + _loop_size(case))
    elements = sum(math.prod(s) for s in shapes.values())
    rest = (model.d_in + _kernels(model.layers) + (model.sizes.get("norm") == "layer")
            + sum(v for k, v in model.sizes.items() if type(v) is int and k != "n_layers")
            + sum(v for o in [case.target_options] + ([ck.target_options] if ck else [])
                  for v in o.values() if type(v) is int))  # (a count option: pp's microbatches, stages per rank)
    return (case.ranks, sum(w + len(m) for w, m in sides), ck is not None, structure, len(shapes),
            len(case.schedule), len(case.groups), mentions, options, ck_extras, extras,
            case.batch, case.seq, 8 if case.dtype == "float64" else 4, elements, rest)


def _loop_size(case: Case) -> int:
    """The training loop's part of a case (kernel/loop.py): each feature used, and what it does beyond its plainest form."""
    clip, sched, scaler = case.clip, case.lr_scheduler, case.scaler
    n = 0
    if clip:
        n += 1 + (clip.how != "norm") + (clip.norm_type != "2") + (clip.foreach is not None) + clip.error_if_nonfinite
    if sched:
        n += 1 + 2 * len(sched.children)
    if scaler:
        n += 1 + len(scaler.overflow) + scaler.amp + (scaler.overflow_at is not None)
    return n


def _count_layers(layers) -> int:
    return sum(1 + _count_layers(layer.children) for layer in layers)


def _kernels(layers) -> int:
    return sum(layer.kernel + _kernels(layer.children) for layer in layers)


def _count(value) -> int:
    """Nodes of a JSON value: dropping any entry lowers it."""
    if isinstance(value, dict):
        return 1 + sum(1 + _count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def _well_formed(data: dict | None) -> Case | None:
    """The Case, or None where the runner could not take it: the validity
    rule refuses it (Case.check: the Case's and the target's checks), or
    groups, flips or the checkpoint name a param the model does not have."""
    if data is None:
        return None
    try:
        case = Case.from_dict(data)
        case.check()
        shapes = param_shapes(case.model)
    except Exception:  # CaseError, or a model that cannot be built (a plugin's: anything)
        return None
    named = [n for g in case.groups for n in g.params] + list(case.frozen)
    named += [n for s in case.schedule for n in (*s.freeze, *s.unfreeze)]
    named += list(case.checkpoint.missing) if case.checkpoint else []
    sizes = case.model.sizes
    thin_norm = sizes.get("norm") == "layer" and sizes["n_heads"] * sizes["head_dim"] < 2  # as the draws avoid it
    if not shapes or not set(named) <= set(shapes) or thin_norm:
        return None
    return case


# -- schedule, groups, flags ---------------------------------------------------

def step_edits(data: dict) -> Iterator[Edit]:
    """Drop a step (the last first), the checkpoint and the added groups kept at steps that still exist."""
    n = len(data["schedule"])
    for k in reversed(range(n)) if n > 1 else ():
        new = copy.deepcopy(data)
        del new["schedule"][k]
        ck, optim = new["checkpoint"], new["optim"]
        if ck and ck["after"] >= k and ck["after"] > 0:
            ck["after"] -= 1
        if optim["added_at"] > k:
            optim["added_at"] -= 1
        optim["added_at"] = min(optim["added_at"], n - 2)
        if "uneven" in new["target_options"]:  # zero: one rank still runs every step
            new["target_options"]["uneven"] = [min(c, n - 1) for c in new["target_options"]["uneven"]]
        if new.get("scaler"):  # the overflows stay at the steps they were drawn for
            new["scaler"]["overflow"] = [j - (j > k) for j in new["scaler"]["overflow"] if j != k]
            at = new["scaler"].get("overflow_at")
            if at:  # a partial overflow too; gone with its step
                new["scaler"]["overflow_at"] = None if at["step"] == k else {**at, "step": at["step"] - (at["step"] > k)}
        yield f"drop step {k}", new


def _group_edits(data: dict) -> Iterator[Edit]:
    """Drop a param group (its params join group 0, or group 1 for group 0), then its overrides."""
    groups = data["groups"]
    for g in reversed(range(len(groups))) if len(groups) > 1 else ():
        new = copy.deepcopy(data)
        into = 1 if g == 0 else 0
        new["groups"][into]["params"] += new["groups"][g]["params"]
        del new["groups"][g]
        optim = new["optim"]
        if g >= len(groups) - optim["added_groups"]:  # one of the groups added after the constructor
            optim["added_groups"] -= 1
            optim["added_at"] = optim["added_at"] if optim["added_groups"] else 0
        yield f"drop param group {g}" + (f" (params to group {into})" if groups[g]["params"] else ""), new
    for g, group in enumerate(groups):
        if group["overrides"]:
            new = copy.deepcopy(data)
            new["groups"][g]["overrides"] = {}
            yield f"group {g}: no overrides", new
        for key in sorted(group["overrides"]) if len(group["overrides"]) > 1 else ():
            new = copy.deepcopy(data)
            del new["groups"][g]["overrides"][key]
            yield f"group {g}: default {key}", new


def _flag_edits(data: dict) -> Iterator[Edit]:
    """Unfreeze a frozen param; drop a step's freeze or unfreeze."""
    for fqn in data["frozen"]:
        yield f"unfreeze {fqn}", changed_copy(data, frozen=[n for n in data["frozen"] if n != fqn])
    for k, step in enumerate(data["schedule"]):
        for flip in ("freeze", "unfreeze"):
            for fqn in step[flip]:
                new = copy.deepcopy(data)
                new["schedule"][k][flip] = [n for n in step[flip] if n != fqn]
                yield f"step {k}: no {flip} of {fqn}", new


def _checkpoint_edits(data: dict) -> Iterator[Edit]:
    """The loading side: set_state_dict not split, nothing missing, no
    unexpected key, then strict; both sides with the same target options."""
    ck = data["checkpoint"]
    if not ck:
        return

    def changed(what, **fields) -> Edit:
        new = copy.deepcopy(data)
        new["checkpoint"].update(fields)
        return f"checkpoint: {what}", new

    if ck["split"]:
        yield changed("one set_state_dict, not split", split=False)
    if ck["missing"]:
        yield changed("nothing missing", missing=[])
    if ck["unexpected"]:
        yield changed("no unexpected key", unexpected=False)
    if not ck["strict"] and not ck["missing"] and not ck["unexpected"]:  # strictness then tells nothing apart
        yield changed("strict", strict=True)
    n_steps = len(data["schedule"])
    if ck["target_options"] != data["target_options"]:
        yield changed("the saving side's target options",
                      target_options=fit_options(data["target"], data["target_options"], ck["mesh_shape"], n_steps))
        yield ("saving side: the loading side's target options",
               changed_copy(data, target_options=fit_options(data["target"], ck["target_options"], data["mesh_shape"], n_steps)))


def _option_edits(data: dict) -> Iterator[Edit]:
    """Drop a target option (back to the target's default), on either side;
    in an option keyed by FQN (placements, wrapped units, a TP plan) one entry
    at a time; a count (pp's microbatches, stages per rank) smaller."""
    fqns = modules(param_shapes(Case.from_dict(data).model))
    ck = data["checkpoint"]
    for side, what in ((data, ""), (ck, "checkpoint ")):
        if not side:
            continue
        for key, value in side["target_options"].items():
            new = copy.deepcopy(data)
            del (new["checkpoint"] if what else new)["target_options"][key]
            yield f"{what}no target option {key}", new
            entries = list(value) if isinstance(value, (dict, list)) and len(value) > 1 else []
            for entry in (e for e in entries if isinstance(e, str) and e in fqns):
                new = copy.deepcopy(data)
                options = (new["checkpoint"] if what else new)["target_options"]
                options[key] = ({k: v for k, v in value.items() if k != entry} if isinstance(value, dict)
                                else [e for e in value if e != entry])
                yield f"{what}{key}: drop {entry}", new
            for smaller in sorted({1, value // 2, value - 1} - {0}) if type(value) is int and value > 1 else ():
                new = copy.deepcopy(data)
                (new["checkpoint"] if what else new)["target_options"][key] = smaller
                yield f"{what}{key} {value} -> {smaller}", new


def _optim_edits(data: dict) -> Iterator[Edit]:
    """Drop the optimizer's extras (named params, add_param_group) and each
    kwarg torch has another default for (lr and the implementation stay; a
    tensor lr: ``_plain_lr``)."""
    optim = data["optim"]

    def changed(what, **fields) -> Edit:
        new = copy.deepcopy(data)
        new["optim"].update(fields)
        return what, new

    if optim["named"]:
        yield changed("params without names", named=False)
    if optim["added_groups"]:
        yield changed("no add_param_group", added_groups=0, added_at=0)
    if optim["added_at"]:
        yield changed("groups added right after the constructor", added_at=0)
    defaults = _torch_defaults(optim["name"])
    for key, value in optim["kwargs"].items():
        if key not in KEEP_KWARGS and defaults.get(key, value) != value:
            kwargs = {k: v for k, v in optim["kwargs"].items() if k != key}
            yield changed(f"{optim['name']}: default {key}", kwargs=kwargs)


def _torch_defaults(name: str) -> dict:
    """{kwarg: default} of the optimizer's constructor, as JSON values (tuples as lists)."""
    from ..kernel.optim import optimizer_class

    try:
        params = inspect.signature(optimizer_class(name).__init__).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return {}
    out = {}
    for p in params:
        if p.default is not inspect.Parameter.empty:
            try:
                out[p.name] = json.loads(json.dumps(p.default))
            except (TypeError, ValueError):  # a default no Case can hold: the kwarg stays
                pass
    return out


def _feature_drops(data: dict) -> Iterator[Edit]:
    """The biggest steps, first: a feature of the case dropped whole (each
    makes every later run cheaper, and each is one run to try): the
    checkpoint, its async save, the grad scaler, an overflow step, the LR
    scheduler, the clipping."""
    def changed(what, **fields) -> Edit:
        return what, changed_copy(data, **fields)

    clip, sched, scaler, ck = data.get("clip"), data.get("lr_scheduler"), data.get("scaler"), data.get("checkpoint")
    if ck:
        yield changed("no checkpoint", checkpoint=None)
        if ck.get("async_save"):
            yield changed("a blocking save", checkpoint={**ck, "async_save": ""})
    if scaler:
        yield changed("no grad scaler", scaler=None)
        for k in scaler["overflow"]:
            yield changed(f"no overflow at step {k}", scaler={**scaler, "overflow": [j for j in scaler["overflow"] if j != k]})
        at = scaler.get("overflow_at")
        if at:
            yield changed(f"no partial overflow at step {at['step']}", scaler={**scaler, "overflow_at": None})
    if sched:
        yield changed("no LR scheduler", lr_scheduler=None)
    if clip:
        yield changed("no clipping", clip=None)


def _plain_lr(data: dict) -> Iterator[Edit]:
    """The plainest lr: a tensor lr as a float, else a 1-element tensor as a 0-d one."""
    kind = data["optim"]["tensor_lr"]
    for plainer in TENSOR_LR[:TENSOR_LR.index(kind)]:
        new = copy.deepcopy(data)
        new["optim"]["tensor_lr"] = plainer
        yield ("lr as a float" if not plainer else f"lr as a {plainer} tensor, not {kind}"), new


def _loop_details(data: dict) -> Iterator[Edit]:
    """The training loop's features (kernel/loop.py) made plainer where
    ``_feature_drops`` could not drop them: clip_grad_norm_ in its plainest
    form; SequentialLR or ChainedScheduler as one of its children; the
    target's own grad scaler; the plainest async save."""
    def changed(what, **fields) -> Edit:
        return what, changed_copy(data, **fields)

    clip, sched, scaler, ck = data.get("clip"), data.get("lr_scheduler"), data.get("scaler"), data.get("checkpoint")
    if clip:
        plain = {"how": "norm", "norm_type": "2", "foreach": None, "error_if_nonfinite": False}
        for key, value in plain.items():
            if clip[key] != value and not (key == "how" and clip["how"] == "own"):
                yield changed(f"clip: {key} {clip[key]} -> {value}", clip={**clip, key: value})
    if sched:
        for i, child in enumerate(sched["children"]):
            yield changed(f"{sched['name']} -> its scheduler {i} ({child['name']})", lr_scheduler=child)
    if scaler and scaler.get("amp"):
        yield changed("the target's own grad scaler", scaler={**scaler, "amp": False})
    if ck and ck.get("async_save") and ck["async_save"] != "thread":  # the plainest async form
        yield changed(f"async_save {ck['async_save']} -> thread", checkpoint={**ck, "async_save": "thread"})


# in order: the biggest steps first (a whole feature, then ranks, then the structure, then the finer things); a
# pass tries each once (``minimize``), so an edit early in the list is also one that every pass tries first
EDITS = (_feature_drops, world_edits, _plain_lr, layer_drops, model_flags, decoder_edits, step_edits, _group_edits,
         _flag_edits, _checkpoint_edits, _option_edits, _optim_edits, _loop_details, size_edits, layer_details)
WORLD = (world_edits,)  # the world pass alone: a simulated finding's least world (onset.least_worlds)
