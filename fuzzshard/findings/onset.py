"""A simulated finding's least world, and the group size a bug begins at (``fuzz --simulate``).

After a simulated session and before its findings are checked on real processes (life.confirm_on_real),
each finding's world is shrunk once more, simulated, with no deadline (``least_worlds``): the one shrinker's
world pass (reduce.py's ``minimize(..., passes=WORLD)``: fewer ranks, a mesh that keeps some of the case's
dims with their placements, the fewest ranks first), its file rewritten so. Then the 1-D world sizes around
it say where the bug begins (``onset``), and findings of one target and oracle that begin at the same group
size are one bug met in several modules, folded into one file (``fold_one_bug``). The pools are the
caller's: a started simulated one is handed in."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from .files import amend_finding, drop_finding, put_finding
from .generalize import Face, generalize
from .judge import judge_many
from .record import Stage, read_record
from .reduce import WORLD, minimize
from .shrink_world import MESH_PARTS, resized

ONSET_ABOVE = 2  # a bug that begins at more ranks than this on a 1-D mesh, and at no fewer, has an onset (fold_one_bug)


def least_worlds(findings: list, out: Path, pools, known: dict, progress=None,
                 optimizer_names: list | None = None) -> dict:
    """Each finding's world size and mesh shrunk on ``pools.simulated()`` (the caller's), to the least that
    gives its signature (the world pass of the one shrinker, judged side by side), its files rewritten so
    (case, verdict, script, ``removed``) and its generalization table made anew for that case
    (generalize.py), with the 1-D world sizes around its onset as rows. Returns signature -> its onset
    (the least 1-D world size it fails from, or None: see fold_one_bug)."""
    todo = [f for f in findings if f.verdict is not None and not oracles.costly(f.verdict)  # no hang, no crash
            and f.stage not in (Stage.PROVISIONAL, Stage.UNCONFIRMED)]
    if not todo:
        return {}
    with pools.simulated() as pool:
        return _least_worlds(todo, out, pool, known, progress or sys.stderr, optimizer_names)


def _least_worlds(todo: list, out: Path, pool, known: dict, progress, optimizer_names) -> dict:
    onsets: dict = {}
    for f in todo:
        tried: dict = {}  # case JSON -> its judgement

        def judged(cases: list) -> list:
            new = [c for c in cases if c.to_json() not in tried]
            for c, j in zip(new, judge_many(pool, new, known) if new else []):
                tried[c.to_json()] = j
            return [tried[c.to_json()] for c in cases]

        r = minimize(f.case, keeps_bugs=lambda cases, sig=f.signature: [j.label == sig for j in judged(cases)],
                     batch=pool.size, passes=WORLD)
        table = [Face(**row) for row in f.generalization]
        if r.kept:
            what = [part for kept in r.kept for part in kept.split(MESH_PARTS)]
            f.case, f.verdict = r.case, tried[r.case.to_json()].verdict
            f.removed = [x for x in f.removed if x not in what] + what
            print(f"fuzzshard: {f.signature}: shrunk simulated to {f.case.ranks} ranks on "
                  f"{list(f.case.mesh_shape)} ({', '.join(what)})", file=progress, flush=True)
            table, faces = generalize(judged, f.case, f.verdict, optimizer_names)  # the table of this case
            f.faces = sorted((set(f.faces) | faces) - {f.signature})
        onsets[f.signature], rows = onset(f, judged)
        f.generalization = [row.to_dict() for row in table if not row.dimension.startswith("world size")] + \
            [row.to_dict() for row in rows]
        put_finding(out, f)  # its files as ``f`` says now (its case, verdict, script), whatever the session wrote
    return onsets


def onset(f, judged) -> tuple:
    """(T, rows): ``f``'s case on 1-D meshes of T .. its own ranks fails (the same oracle, a new bug: the
    signature may change with the world size, where another module is the first wrong) and passes on T - 1,
    T > ONSET_ABOVE; and the same case with every width scaled so that each shard is even at T - 1 and at T
    ranks (``_widened``) does not say otherwise (it fails so at T - 1: then the shapes made the onset, not
    the group size; a known bug there says nothing). Where it passes at T with even shards, the bug needs an
    uneven one (a collective below the modules over uneven shards): then the case with every width made
    uneven at T - 1 and at T alike (``_skewed``, no shard empty) must pass at T - 1 and fail so at T, else
    an uneven or empty shard made the onset. A bug that begins at a group size. Else (None, rows). rows:
    generalize.Face rows of the world sizes tried."""
    n = f.case.ranks
    if len(f.case.mesh_shape) != 1 or n <= ONSET_ABOVE:
        return None, []

    def fails_so(j) -> bool:
        return j is not None and j.verdict.is_finding and not j.known and j.verdict.oracle == f.verdict.oracle

    sizes = [w for w in range(ONSET_ABOVE, n + 2) if w != n]
    tried = {w: c for w in sizes if (c := resized(f.case, w)) is not None}
    seen = dict(zip(tried, judged(list(tried.values()))))
    t = n
    while t - 1 in seen and t - 1 > ONSET_ABOVE and fails_so(seen[t - 1]):
        t -= 1
    rows = [Face("world size (1-D mesh)", str(n), "fails", f.signature)]
    for w, j in sorted(seen.items()):
        if t - 1 <= w:
            rows.append(_row("world size (1-D mesh)", w, j, f.signature))
    rows.sort(key=lambda r: int(r.value))
    below = seen.get(t - 1)
    if t <= ONSET_ABOVE or below is None or below.verdict.status != "pass":
        return None, rows
    wide = _widened(f.case, math.lcm(t - 1, t))
    if wide is None:
        return t, rows
    dim = f"world size, widths x{wide[1]} (every shard even)"
    pair = [c for c in (resized(wide[0], t - 1), resized(wide[0], t)) if c is not None]
    if len(pair) < 2:
        return t, rows
    under, at = judged(pair)
    rows += [_row(dim, t - 1, under, f.signature), _row(dim, t, at, f.signature)]
    if fails_so(under) or at.verdict.status != "pass":
        return (None if fails_so(under) else t), rows
    # it needs an uneven shard at T (a collective over uneven shards): the onset is still the group size's
    # where, every shard uneven at T - 1 and at T alike (``_skewed``), it passes at T - 1 and fails at T
    skew = _skewed(f.case, t - 1, t)
    pair = [c for c in (resized(skew[0], t - 1), resized(skew[0], t)) if c is not None] if skew else []
    if len(pair) < 2:
        return None, rows
    under, at = judged(pair)
    dim = f"world size, widths x{skew[1]} + 1 (every shard uneven)"
    rows += [_row(dim, t - 1, under, f.signature), _row(dim, t, at, f.signature)]
    return (t if under.verdict.status == "pass" and fails_so(at) else None), rows


def _row(dimension: str, w: int, j, sig: str):
    """A generalize.Face row: what the case gave at ``w`` ranks."""
    status = j.verdict.status
    outcome = ("fails" if j.label == sig else "fails otherwise" if status == "finding" else
               {"pass": "passes", "invalid": "invalid"}.get(status, "error"))
    return Face(dimension, str(w), outcome, j.label if status == "finding" else "")


WIDE_MAX = 512  # the widest layer _widened makes (a Linear of 512x512 is a small case still)


def _widths(case) -> list[int] | None:
    """Every width of ``case``'s model (its input's, each layer's in and out), or None for a plugin's model."""
    model = case.to_dict()["model"]
    if model.get("factory"):
        return None
    widths, stack = [model["d_in"]], list(model["layers"])
    while stack:
        layer = stack.pop()
        widths += [w for w in (layer["d_in"], layer["d_out"]) if w]
        stack += layer["children"]
    return widths


def _rewidth(case, new):
    """``case`` with every nonzero width w of its model made ``new(w)``, or None where that case cannot be."""
    from ..case import Case

    data = case.to_dict()
    model = data["model"]

    def apply(layer):
        layer.update(d_in=layer["d_in"] and new(layer["d_in"]), d_out=layer["d_out"] and new(layer["d_out"]))
        for child in layer["children"]:
            apply(child)

    model["d_in"] = new(model["d_in"])
    for layer in model["layers"]:
        apply(layer)
    try:
        rewidthed = Case.from_dict(data)
        rewidthed.check()
        return rewidthed
    except Exception:
        return None


def _widened(case, even: int):
    """(``case`` with every width of its model times k, k) where k is the least that makes every width a
    multiple of ``even``, or None (a plugin's model, wider than WIDE_MAX, or a case that cannot be)."""
    widths = _widths(case)
    if widths is None:
        return None
    k = math.lcm(*(even // math.gcd(w, even) for w in widths))
    if k == 1 or max(widths) * k > WIDE_MAX:
        return None if k != 1 else (case, 1)
    wide = _rewidth(case, lambda w: w * k)
    return (wide, k) if wide is not None else None


def _skewed(case, a: int, b: int):
    """(``case`` with every width w of its model made k * w + 1, k) where k = lcm(a, b): every width then
    splits unevenly over ``a`` and over ``b`` ranks, and (``a``, ``b`` consecutive) no rank's shard is empty;
    None where it cannot be (a plugin's model, wider than WIDE_MAX, or a case the new widths break)."""
    widths = _widths(case)
    if widths is None:
        return None
    k = math.lcm(a, b)
    if max(widths) * k + 1 > WIDE_MAX:
        return None
    skewed = _rewidth(case, lambda w: w * k + 1)
    return (skewed, k) if skewed is not None else None


def fold_one_bug(findings: list, onsets: dict, out: Path, progress=None) -> dict:
    """One bug, one file: findings of one target and oracle that begin at the
    same group size (``onsets``, see onset: least at T ranks on a 1-D mesh,
    and with every shard even, passing at T - 1 and failing at T) are one bug
    met in several modules (a Partial sum wrong over T+ ranks shows in a
    Linear, an Embedding, a LayerNorm, forward or backward): the least case
    keeps its file, the others become its faces (their signatures, and their
    cases under ``simulation.folded``) and their files go. Returns
    signature -> the finding it was folded into."""
    progress = progress or sys.stderr
    groups: dict = {}
    for f in findings:
        t = onsets.get(f.signature)
        if t is not None and (out / f"{f.signature}.json").exists():
            groups.setdefault((f.case.target, f.verdict.oracle, t), []).append(f)
    folded: dict = {}
    for (_, _, t), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        members.sort(key=lambda m: (m.case.ranks, len(m.case.to_json()), m.signature))
        owner, rest = members[0], members[1:]
        simulation = read_record(out, owner.signature).get("simulation") or {}
        owner.faces = sorted(set(owner.faces) | {s for m in rest for s in [m.signature, *m.faces]} - {owner.signature})
        simulation["folded"] = [  # each face's own case and what real processes said of it
            {"signature": m.signature, "onset": t, "case": json.loads(m.case.to_json()), "summary": m.summary,
             "simulation": read_record(out, m.signature).get("simulation")} for m in rest]
        amend_finding(out, owner.signature, faces=owner.faces, simulation=simulation)
        for m in rest:
            folded[m.signature] = owner.signature
            drop_finding(out, m.signature)
            print(f"fuzzshard: {m.signature}: another face of finding {owner.signature} (both begin at {t} ranks on a "
                  f"1-D mesh, passing on {t - 1}: a group size, not their shapes), folded into it", file=progress)
    return folded
