"""Coverage-guided scheduling: what a timed session's next round draws.

The session counts, per target, what its cases covered, cell by cell, in a
few dimensions (``features``): optimizer x implementation, the optimizer's
flags, world size and mesh, checkpoint kind x (save -> load) world sizes,
dtype, the target's options, groups, frozen params and steps. Before each
round, ``Scheduler.steer`` turns those counts into weighted choices the
strategy draws from (strategies.cases(steer=...)): every cell stays
possible, and a cell drawn less often so far gets proportionally more of the
round (a power schedule, as AFL's and HypoFuzz's share time between inputs
and targets): weight ``ceil(ENERGY * (least + 1) / (count + 1))``, so a
never-drawn cell gets ENERGY times the weight of one drawn as often as the
most drawn, and the weights even out as the counts do.

Steered jointly, as one cell each:
  - *optimizer x implementation* (for-loop, foreach, fused), and that with
    the world size as a pair: each world size's cases go to the optimizers
    least drawn *at that world size* (2-way coverage, as covering arrays give:
    a bug that needs one optimizer at one world size, say Rprop at 3 ranks, is
    met within one pass over the optimizers of that world size instead of by
    chance at 1 in (optimizers x world sizes) per case);
  - *world size x checkpoint*: none, or kind x the world size it loads at (a
    case saved at 4 ranks and loaded at 3 is one cell); with checkpoints in
    some cases, the cases without one keep half of each world size's weight;
  - *mesh* of each world size, and *dtype*;
  - the target's *option corner* (its Spec's ``corner``: pp's ``ep``, ep's ``tp``), on the meshes that allow
    it: a case there is aimed at it or not (off first, so it shrinks to today's draw), on and off evened out,
    so a corner that needs several rare draws at once (pp's ep: a [pp, dp] mesh, an MoE whose experts divide
    over dp, ep drawn, no checkpoint: 1 case in ~300 of a session's at world size 4) gets its share.
A case that hit a known bug counts ``KNOWN_DRAWS`` times: its cells get
less of the next rounds (such a case shows nothing new, and its run stopped
at that bug); but one whose bug was raised before its optimizer first
stepped (while sharding, in the first forward/backward: an Embedding's or a
Conv1d's) counts once for its optimizer cells, which it never tested: a rare
optimizer x world size pair is not pushed away by what the model hit.
The rest (flags, the model's input and layer kinds, target options, groups,
frozen params, steps) is counted and shown in the coverage table, not
steered: the draws there stay Hypothesis's own (steering the model cost the
hunt's HSDP 2x2 corner two of its three seeds, docs/search.md). The
weights are fixed for a round, so a round is one ordinary Hypothesis run:
each draw is a function of its choices, and
shrinking works as before; the least covered cell is listed first, so the
all-zero first draw of a round goes there.
"""
from __future__ import annotations

import collections
import math

from fuzzshard.kernel.moe import moe_cells
from fuzzshard.strategies.models import KINDS

ENERGY = 8  # a never-drawn cell's weight over that of the most drawn one
KNOWN_DRAWS = 3  # a case that hit a known bug counts as this many draws of its cells: it showed nothing new, and
# whatever else its cells hold hides behind that bug (its run stopped there, often with a pool restart)

PAIRS = "world x optimizer"  # steered, counted, but not a table row: optimizers x world sizes cells are many
OPTIMIZER_DIMS = ("optimizer", PAIRS, "optimizer flag")  # what a known bug before the first step says nothing of
STEERED = ("optimizer", "world x checkpoint", "mesh", "dtype", "option corner")
DIMENSIONS = ("optimizer", "optimizer flag", "world x checkpoint", "mesh", "dtype", "model", "target option",
              "option corner", "groups", "frozen", "steps", "loop", "dropout")


def _opt_flags(optim) -> list[str]:
    """The optimizer's boolean flags that are on, and tensor lr / named params: cells of its own."""
    kw = optim.kwargs
    out = [k for k, v in sorted(kw.items()) if v is True and k not in ("foreach", "fused")]
    if kw.get("momentum"):
        out.append("momentum")
    if kw.get("weight_decay"):
        out.append("weight_decay")
    if optim.tensor_lr:
        out.append(f"tensor lr {optim.tensor_lr}")
    if optim.named:
        out.append("named")
    return [f"{optim.name}·{f}" for f in out] or [f"{optim.name}·plain"]


def _options(value, prefix: str = "") -> list[str]:
    """A target's options as cells: flags and values by key; a dict keyed by
    param names (placements, shard specs) by the values it holds."""
    out = []
    if isinstance(value, dict):
        by_param = value and all("." in str(k) or str(k) in ("weight", "bias") for k in value)
        for k, v in sorted(value.items(), key=lambda kv: str(kv[0])):
            out += _options(v, prefix if by_param else f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(x, str) and "." not in x for x in value):
            out += [f"{prefix} {x}" for x in value]
        elif value:
            out.append(prefix)
    elif isinstance(value, bool):
        if value:
            out.append(prefix)
    elif value is not None and isinstance(value, (str, int, float)) and prefix:
        out.append(f"{prefix}={value}")
    return out


def checkpoint_cell(case) -> str:
    ck = case.checkpoint
    return f"W{case.world_size} no checkpoint" if not ck else f"W{case.world_size} {ck.kind} -> W{ck.world_size}"


def features(case) -> list[tuple[str, str]]:
    """(dimension, cell) for each cell ``case`` covers (PAIRS too, which the coverage table leaves out)."""
    o = case.optim
    out = [("optimizer", f"{o.name}·{o.implementation}"), (PAIRS, f"W{case.world_size} {o.name}·{o.implementation}")]
    out += [("optimizer flag", f) for f in _opt_flags(o)]
    out.append(("world x checkpoint", checkpoint_cell(case)))
    out.append(("mesh", "x".join(map(str, case.mesh_shape))))
    out.append(("dtype", case.dtype))
    out += [("target option", f) for f in dict.fromkeys(_options(case.target_options))]
    from ..kernel.ac import ac_how  # activation checkpointing's form, a cell of its own (fsdp2's default has no key)

    if ac_how(case.target_options):
        out.append(("target option", f"ac form {ac_how(case.target_options)}"))
    out.append(("groups", f"{len(case.groups)} group(s)" + (" (one empty)" if any(not g.params for g in case.groups) else "")))
    flips = any(s.freeze or s.unfreeze for s in case.schedule)
    out.append(("frozen", ("frozen" if case.frozen else "none frozen") + (", flipped mid-run" if flips else "")))
    out.append(("steps", f"{len(case.schedule)} step(s)"))
    out += [("loop", f) for f in loop_cells(case)]
    from fuzzshard.kernel.dropout import dropout_coverage as dropout_cells  # how its masks were judged, and where

    out += [("dropout", c) for c in dropout_cells(case).get("dropout", {})]  # (none: no line in a session without)
    m = case.model
    tie = _tie(case)
    if tie:  # counted, not steered (as the model's other cells): how the target sharded the tied weight
        out.append(("model", f"tied: {tie}"))
    if not m.factory:  # a drawn topology: its input and the kinds of layer it has
        out.append(("model", f"{m.input} in"))
        out += [("model", f"layer {k}") for k in dict.fromkeys(layer.kind for layer in m.layers) if k in KINDS]
    out += [("model", c) for c in moe_cells(m)]
    corner = corner_cell(case)
    if corner:
        out.append(("option corner", corner))
    return out


def _spec(case):
    """The case's target's Spec; None for a plugin's target this process has not registered."""
    from fuzzshard import targets

    try:
        return targets.get(case.target).spec
    except KeyError:  # a plugin's target this process has not registered
        return None


def corner_cell(case) -> str:
    """The target's steered corner (its Spec's ``corner``) where the case's mesh allows it: the option's name if
    the case has it on, "no OPTION" if not; "" where the mesh does not allow it (or the target has none)."""
    spec = _spec(case)
    corner = spec.corner if spec is not None else None
    if not corner or len(case.mesh_shape) != corner["mesh_dims"]:
        return ""
    return corner["option"] if case.target_options.get(corner["option"]) else f"no {corner['option']}"


def _tie(case) -> str:
    """The target's words for how it shards the case's tied weight (Spec.tie), "" untied or unsaid."""
    spec = _spec(case)
    tie = spec.tie if spec is not None else None
    return tie(case) if tie else ""


def loop_cells(case) -> list[str]:
    """The training loop around the step a case used (kernel/loop.py): a cell per feature and its form."""
    out = []
    if case.clip:
        out.append(f"clip {case.clip.how}" + (f" norm {case.clip.norm_type}" if case.clip.how != "value" else ""))
    if case.lr_scheduler:
        out.append(f"lr {case.lr_scheduler.name}")
    if case.scaler:
        out.append("scaler" + (" (amp's)" if case.scaler.amp else "") + (" with overflow" if case.scaler.overflow else ""))
    if case.checkpoint and case.checkpoint.async_save:
        out.append(f"async save {case.checkpoint.async_save}")
    return out or ["none"]


def stepped(verdict) -> bool:
    """Whether the case's optimizer stepped before its verdict: an error raised
    while sharding or in the first forward/backward came before it."""
    e = verdict.error_record
    stage = e.extra.get("stage")
    return not (stage == "shard" or stage == "fwdbwd" and (e.phase or "").startswith("step 0:"))


def weights(counts: dict) -> list:
    """Each cell as many times as its weight, the least covered first (ties in the given order)."""
    if not counts:
        return []
    least = min(counts.values())
    order = sorted(counts, key=lambda c: counts[c])  # stable: ties keep their order
    times = {c: -(-ENERGY * (least + 1) // (counts[c] + 1)) for c in order}
    common = math.gcd(*times.values())
    return [c for c in order for _ in range(times[c] // common)]


class Scheduler:
    """Per target: the cells drawn (every case run, valid or not: a cell that
    is mostly invalid must not hold the schedule) and the valid ones (the table)."""

    def __init__(self):
        self.drawn: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # target -> (dim, cell)
        self.valid: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def record(self, case, valid: bool, known: bool = False, verdict=None) -> None:
        """``verdict``: where a known hit was raised says which of its cells it covered (``stepped``)."""
        cells = features(case)
        masked = known and verdict is not None and not stepped(verdict)
        for cell in cells:
            hidden = masked and cell[0] in OPTIMIZER_DIMS  # the bug came before the optimizer stepped
            self.drawn[case.target][cell] += KNOWN_DRAWS if known and not hidden else 1
        if valid:
            self.valid[case.target].update(cells)

    def steer(self, target: str, world_sizes, strategy_kwargs: dict) -> dict:
        """The strategy arguments of the next round of ``target``: ``steer`` (see strategies.cases)."""
        from fuzzshard.case import mesh_shapes
        from fuzzshard.strategies import DTYPES, NOT_ELEMENTWISE, spec_of
        from fuzzshard.strategies.optimizers import default_optimizers, implementations

        spec = spec_of(target)
        seen = self.drawn[target]
        names = list(strategy_kwargs.get("optimizer_names") or default_optimizers())
        if spec.elementwise_only:
            names = [n for n in names if n not in NOT_ELEMENTWISE]
        impl = strategy_kwargs.get("implementation")
        turns = [(n, i) for n in names for i in implementations(n) if impl is None or i == impl]
        worlds = sorted(set(world_sizes))
        steer = {"optimizer by world": {w: weights({t: seen[PAIRS, f"W{w} {t[0]}·{t[1]}"] for t in turns})
                                        for w in worlds}}

        checkpoint = strategy_kwargs.get("checkpoint")  # None: in some cases, True: every case, False: none
        kinds = list(spec.checkpoint_kinds or ()) if checkpoint is not False else []
        # each world size's share: by how often it has been drawn (least first); then its cells
        share = weights({w: sum(n for (dim, c), n in seen.items() if dim == "world x checkpoint"
                                and c.startswith(f"W{w} ")) for w in worlds})
        plan = []
        for w in dict.fromkeys(share):
            mass = share.count(w)
            with_ck = weights({(w, (k, w2)): seen["world x checkpoint", f"W{w} {k} -> W{w2}"]
                               for k in kinds for w2 in worlds})
            if checkpoint is True and with_ck:
                plan += with_ck * mass
            elif with_ck:  # some: half of the world's draws without a checkpoint, half with one
                plan += [(w, None)] * (mass * len(with_ck)) + with_ck * mass
            else:
                plan += [(w, None)] * mass
        steer["plan"] = plan
        steer["mesh"] = {w: weights({m: seen["mesh", "x".join(map(str, m))] for m in _meshes(spec, w, mesh_shapes)})
                         for w in worlds}
        dtypes = list(strategy_kwargs.get("dtypes") or DTYPES)
        steer["dtype"] = weights({d: seen["dtype", d] for d in dtypes})
        if strategy_kwargs.get("loop"):  # the training loop's forms: each feature stays half on, half off
            from fuzzshard.strategies.loop import SCHEDULERS

            def drawn(word: str) -> dict:  # cells "clip FORM ..." / "lr NAME" -> drawn cases by FORM / NAME
                out: dict = {}
                for (dim, cell), n in seen.items():
                    if dim == "loop" and cell.split(" ")[0] == word:
                        out[cell.split(" ")[1]] = out.get(cell.split(" ")[1], 0) + n
                return out

            clip, lr = drawn("clip"), drawn("lr")
            steer["loop"] = {"clip": weights({f: clip.get(f, 0) for f in spec.clips}),
                             "lr_scheduler": weights({s: lr.get(s, 0) for s in SCHEDULERS}) if spec.lr_scheduler else []}
        if spec.corner:  # the target's corner, where a mesh allows it: on and off evened out; off first (it shrinks there)
            option = spec.corner["option"]
            steer["corner"] = sorted(weights({False: seen["option corner", f"no {option}"],
                                              True: seen["option corner", option]}), key=bool)
        if strategy_kwargs.get("ac") and spec.ac:  # activation checkpointing's forms, the least drawn first
            steer["ac"] = weights({h: seen["target option", f"ac form {h}"] for h in spec.ac})
        return {"steer": steer}

    def table(self, target: str | None = None, width: int = 100) -> str:
        """The valid cases per cell, by dimension: the session's spread (least covered first)."""
        lines = []
        for t in sorted(self.valid) if target is None else [target]:
            counts = self.valid[t]
            if not counts:
                continue
            lines.append(f"coverage of {t} (valid cases per cell, least first):")
            for dim in DIMENSIONS:
                cells = sorted(((c, n) for (d, c), n in counts.items() if d == dim), key=lambda cn: (cn[1], cn[0]))
                if not cells:
                    continue
                ns = [n for _, n in cells]
                head = f"  {dim} ({len(cells)} cells, {min(ns)}-{max(ns)}): "
                text = ", ".join(f"{c} {n}" for c, n in cells)
                lines.append(head + text)
        return "\n".join(lines)


def _meshes(spec, world: int, mesh_shapes) -> list:
    return [(world,)] if spec.flat_mesh else mesh_shapes(world)
