"""The check of a simulated session's findings on real process groups (``fuzz --simulate``).

A simulated finding (kernel/simulated.py: every rank of a case in one process,
under LocalTensorMode) is a finding only once its shrunk case fails the same
way on real gloo process groups (``confirm``); one that passes there is a
LocalTensor limitation, written under OUT/simulation_limits/ and never
reported as a finding; one too large for this machine is "simulated only".
Before that each finding's world is shrunk once more, simulated
(``least_worlds``), and findings that are one bug met in several modules are
folded into one file (``fold_one_bug``). During the session, the book
(``SimulatedBook``) sets LocalTensor's own errors aside unshrunk for this check.

Every file this writes goes through the writer of findings/life.py
(``put_finding``, ``amend_finding``, ``keep_apart``, ``set_apart``,
``drop_finding``). The pools it starts are made from the session's typed
pool options (pool/options.py), simulated or real. docs/simulate.md says more.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from .life import FindingBook, _smaller, amend_finding, drop_finding, keep_apart, put_finding, set_apart
from .record import Stage

# the largest world size confirmed on real process groups here (ranks are processes: 8 on this machine)
REAL_MAX_ENV = "FUZZSHARD_REAL_MAX"
REAL_MAX = int(os.environ.get(REAL_MAX_ENV, "8"))
SIMULATED_ONLY = Stage.SIMULATED_ONLY.value  # the stage of a finding too large to confirm here (cli/fuzz.py prints it)
LIMITS = "simulation_limits"  # OUT/<this>/: simulated findings that do not reproduce on real process groups


# -- the driver side: LocalTensor's own errors, set aside unshrunk -------------------------------------
# Errors LocalTensor itself raises where a real rank could not: a simulated
# case that ends in one is no finding of the kind a real run gives, so the
# session neither confirms it in fresh simulated workers nor shrinks it (a
# minute or more of simulated cases, for a file the real check then sets
# apart): its smallest case goes straight to the real-process check at the
# session's end (confirm(set_aside=...)), which stays the judge; one of more
# ranks than run for real here is first tried on 1-D worlds of at most
# REAL_MAX ranks, simulated, and checked at the largest that fails the same.
# Each: what the message holds, what the traceback holds, why (docs/simulate.md):
LOCAL_TENSOR_ERRORS = (  # (the message holds, the traceback holds or "", why)
    # _local_tensor's _combine_any_rank_results: an op's result other than a tensor or an int differs between
    # the simulated ranks. Seen: Adafactor's p.norm(2).item() where the norm is Partial (a float per rank), and
    # torch.chunk of a LocalTensor whose ranks hold shards of different lengths (lists of different lengths)
    ("Non Tensor or int rank results must be equal for all ranks", "",
     "an op's non-tensor, non-int results differ between the simulated ranks (a float from .item(), a list of "
     "another length per rank): LocalTensor carries per-rank tensors and ints only"),
    # the same lists of different lengths where rank 0's is the longer: the shorter ranks' missing entries are
    # None, and LocalTensor({rank: tensor or None}) asks None for requires_grad
    ("'NoneType' object has no attribute 'requires_grad'", "_combine_any_rank_results",
     "an op returned lists of different lengths on the simulated ranks (torch.chunk of shards of different "
     "lengths): LocalTensor pads the shorter with None and cannot make a LocalTensor of them"),
    # a per-rank size (LocalIntNode, a SymInt's node) asked what only a symbolic shape answers: indexing with a
    # boolean mask whose length differs between the ranks (MaskPartial's buffer over uneven shards)
    ("'torch._C._SymNode' object has no attribute", "",
     "a per-rank size (LocalIntNode) lacks a SymNode method torch asks of it (statically_known_true, ...)"),
)


def local_tensor_error(verdict) -> str | None:
    """Why a simulated verdict ended in one of LocalTensor's own errors (LOCAL_TENSOR_ERRORS), or None."""
    if not verdict.is_finding or verdict.error is None:
        return None
    e = verdict.error_record
    message, where = e.message or "", e.traceback or ""
    return next((why for text, frame, why in LOCAL_TENSOR_ERRORS if text in message and frame in where), None)



class SimulatedBook(FindingBook):
    """fuzz --simulate's book (session/simulate.py's SimulatedSession keeps it): LocalTensor's own errors
    (``LOCAL_TENSOR_ERRORS``) set aside, unshrunk, for the real-process check at the session's end
    (``confirm(set_aside=book.set_aside)``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_aside: dict = {}  # signature -> (its smallest case, verdict, why, hits)

    def accept(self, sig: str, case, verdict) -> bool:
        why = local_tensor_error(verdict)
        held = self.set_aside.get(sig)
        if why is None or sig in self.tracks:
            return super().accept(sig, case, verdict)
        if held is None:
            self._say(f"{sig}: LocalTensor's own error ({why}): not shrunk, set aside for the real-process "
                      f"check at the session's end")
        hits = held[3] + 1 if held else 1
        best = (case, verdict) if held is None or _smaller(case, held[0]) else held[:2]
        self.set_aside[sig] = (*best, why, hits)
        return False


# -- the driver side: confirming on real process groups ------------------------------------------------
def confirm(findings: list, out: str | Path, options, progress=None, set_aside: dict | None = None,
            workers: int | None = None, optimizer_names: list | None = None) -> dict:
    """Each simulated finding's case run on real gloo process groups (fresh
    workers, its own world size) where it fits this machine (<= REAL_MAX):
      * the same signature: confirmed, its file says so (``simulation``);
      * anything else: a LocalTensor limitation (or a harness one), its files
        moved to OUT/simulation_limits/ with what the real run said;
      * larger than REAL_MAX: "simulated only", its file says so.
    Returns {"confirmed": [...], "limits": [...], "simulated_only": [...]} (signatures).

    Before that, each finding's world size and mesh are shrunk, simulated, as
    far as its signature allows (``least_worlds``: its file's case is then the
    least case that fails, and what it checked on real processes); after it,
    findings that are one bug met in several modules are folded into one file
    (``fold_one_bug``: then the result also holds "folded", signature -> the
    finding it is a face of).

    ``set_aside`` (SimulatedBook's: signature -> (case, verdict, why, hits)):
    LocalTensor's own errors, unshrunk, each run on real processes too: the
    same signature there makes it a finding after all; another finding there
    that is not a known one is written as a finding of its own (the real
    run's signature: a real bug the simulated run only stumbled over); else
    (a pass, a known bug) it goes to OUT/simulation_limits/. Then the result
    also holds "set_aside" (signatures) and "found" (the Findings written).
    A real run that gives a finding already written in ``out`` leaves its file
    as it is (shrunk, confirmed): "met" says signature -> that finding.

    ``options``: the session's pool options (pool/options.py): the real pools
    and the simulated ones (``workers`` side by side) are made from them;
    ``optimizer_names``: what generalizing may swap in (the session's --optimizers)."""
    from .record import load_known

    progress = progress or sys.stderr
    known = load_known()
    out = Path(out)
    result: dict = {"confirmed": [], "limits": [], "simulated_only": []}
    onsets = least_worlds(findings, out, options, known, progress, workers, optimizer_names)
    for f in findings:
        path = out / f"{f.signature}.json"
        w = f.case.ranks
        if not path.exists():  # not on disk (a caller's own Finding): written first, then amended as any other
            put_finding(out, f)
        if w > REAL_MAX:
            f.stage = Stage.SIMULATED_ONLY  # what the session's FINDING line and index say of it
            amend_finding(out, f.signature, stage=SIMULATED_ONLY, simulation={
                "status": SIMULATED_ONLY, "world_size": w,
                "why": f"{w} ranks: more than the {REAL_MAX} this machine runs for real"})
            result["simulated_only"].append(f.signature)
            print(f"fuzzshard: {f.signature}: SIMULATED ONLY (world size {w} > {REAL_MAX})", file=progress)
            continue
        print(f"fuzzshard: {f.signature}: confirming on {w} real gloo processes", file=progress, flush=True)
        j, env, real = _judge_for_real(f.case, options, known)
        if j.signature == f.signature:
            amend_finding(out, f.signature, simulation={"status": "confirmed on real process groups", "real": real})
            result["confirmed"].append(f.signature)
            print(f"fuzzshard: {f.signature}: CONFIRMED on {w} real processes", file=progress)
        else:
            limits = out / LIMITS
            data = json.loads(path.read_text())
            data["simulation"] = {"status": "LocalTensor limitation: not reproduced on real process groups",
                                  "real": real}
            set_apart(out, LIMITS, f.signature, data)
            result["limits"].append(f.signature)
            print(f"fuzzshard: {f.signature}: not a finding: real processes give {j.label} "
                  f"-> {limits}/{f.signature}.json (a LocalTensor limitation)", file=progress)
            if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
                result.setdefault("met", {})[f.signature] = j.signature  # a finding already written: its file kept
            elif j.verdict.is_finding and not j.known:  # the real run fails otherwise, with no known bug: a finding
                found = _write_real(out, f.case, j, env, f"found on real process groups through the simulated "
                                    f"finding {f.signature}, which LocalTensor shows otherwise", real)
                result.setdefault("found", []).append(found)
                print(f"fuzzshard: {f.signature}: real processes give a NEW finding {j.signature} "
                      f"-> {out}/{j.signature}.json", file=progress)
    folded = fold_one_bug([f for f in findings if f.signature not in result["limits"]], onsets, out, progress)
    if folded:
        result["folded"] = folded
        for key in ("confirmed", "simulated_only"):
            result[key] = [s for s in result[key] if s not in folded]
    if set_aside:
        result.update(set_aside=[], found=[])
        _confirm_set_aside(set_aside, out, options, result, progress)
    return result


# -- the driver side: each simulated finding at the least world its bug needs ------------------------------
# A session shrinks a finding as any session does (Hypothesis, then reduce.py),
# within its time; the reducer's world edits keep a 2-D mesh's first dim only.
# Here, after the session and before the real check, a finding's world is
# shrunk once more, simulated, with no deadline: every smaller mesh, each
# keeping any of the case's mesh dims (its placements with it), least first.
ONSET_ABOVE = 2  # a bug that begins at more ranks than this on a 1-D mesh, and at no fewer, has an onset (fold_one_bug)


def world_shrinks(case) -> list[tuple[list[str], object]]:
    """Every smaller world and mesh of ``case`` (no checkpoint: a simulated
    session draws none), least first: fewer ranks, then fewer mesh dims (the
    1-D mesh of the same world too). A new mesh keeps some of the case's mesh
    dims, each at most its size; a param's placements keep those dims'. Each
    with what it changed ("world size 16 -> 6", "mesh [8, 2] -> [6]")."""
    import itertools
    import math

    from ..case import Case

    if case.checkpoint:
        return []
    shape, world = list(case.mesh_shape), case.ranks
    out, seen = [], {case.to_json()}
    for k in range(1, len(shape) + 1):
        for kept in itertools.combinations(range(len(shape)), k):
            for mesh in itertools.product(*(range(1 if k == 1 else 2, shape[d] + 1) for d in kept)):
                mesh = list(mesh)
                ranks = math.prod(mesh)
                if ranks > world or (ranks == world and k >= len(shape)):
                    continue
                try:
                    smaller = Case.from_dict(_projected(case.to_dict(), kept, mesh))
                    smaller.check_world()
                except Exception:  # a mesh the case's options cannot take: not tried
                    continue
                if smaller.to_json() in seen:
                    continue
                seen.add(smaller.to_json())
                what = ([f"world size {world} -> {ranks}"] if ranks < world else []) + \
                       ([f"mesh {shape} -> {mesh}"] if mesh != [ranks] or len(shape) > 1 else [])
                out.append((ranks, k, what, smaller))
    out.sort(key=lambda t: (t[0], t[1]))
    return [(what, c) for _, _, what, c in out]


def _projected(data: dict, kept: tuple, mesh: list) -> dict:
    """``data`` on ``mesh``, whose dims are the case's ``kept`` ones: placements per mesh dim picked, then
    reduce.py's re-fitting (options, batch) to that mesh."""
    from .reduce import _reworld

    placements = data["target_options"].get("placements")
    if placements:
        data["target_options"]["placements"] = {n: [p[d] for d in kept] for n, p in placements.items()}
    return _reworld(data, False, mesh)


def least_worlds(findings: list, out: Path, options, known: dict, progress=None, workers: int | None = None,
                 optimizer_names: list | None = None) -> dict:
    """Each finding's world size and mesh shrunk, simulated, to the least that
    gives its signature (``world_shrinks``, judged side by side), its files
    rewritten so (case, verdict, script, ``removed``) and its generalization
    table made anew for that case (generalize.py), with the 1-D world sizes
    around its onset as rows. Returns signature -> its onset (the least 1-D
    world size it fails from, or None: see fold_one_bug)."""
    from .generalize import Face, generalize
    from .judge import judge_many

    todo = [f for f in findings if f.verdict is not None and not oracles.costly(f.verdict)  # no hang, no crash
            and f.stage not in ("provisional", "unconfirmed")]
    if not todo:
        return {}
    progress = progress or sys.stderr
    pool = start_simulated(options, workers)
    onsets: dict = {}
    try:
        for f in todo:
            tried: dict = {}  # case JSON -> its judgement

            def judged(cases: list) -> list:
                new = [c for c in cases if c.to_json() not in tried]
                for c, j in zip(new, judge_many(pool, new, known) if new else []):
                    tried[c.to_json()] = j
                return [tried[c.to_json()] for c in cases]

            least = _least(f, judged, pool.size)
            table = [Face(**row) for row in f.generalization]
            if least is not None:
                what, f.case, f.verdict = least
                f.removed = [r for r in f.removed if r not in what] + what
                print(f"fuzzshard: {f.signature}: shrunk simulated to {f.case.ranks} ranks on "
                      f"{list(f.case.mesh_shape)} ({', '.join(what)})", file=progress, flush=True)
                table, faces = generalize(judged, f.case, f.verdict, optimizer_names)  # the table of this case
                f.faces = sorted((set(f.faces) | faces) - {f.signature})
            onsets[f.signature], rows = _onset(f, judged)
            f.generalization = [row.to_dict() for row in table if not row.dimension.startswith("world size")] + \
                [row.to_dict() for row in rows]
            _rewrite(out, f)
    finally:
        pool.close()
    return onsets


def _least(f, judged, batch: int):
    """(what changed, the least case, its verdict) of ``f``'s smaller worlds that give its signature, or None."""
    shrinks = world_shrinks(f.case)
    for at in range(0, len(shrinks), max(1, batch)):
        chunk = shrinks[at:at + max(1, batch)]
        hit = next(((what, c, j.verdict) for (what, c), j in zip(chunk, judged([c for _, c in chunk]))
                    if j.label == f.signature), None)
        if hit is not None:
            return hit
    return None


def _onset(f, judged) -> tuple:
    """(T, rows): ``f``'s case on 1-D meshes of T .. its own ranks fails (the same oracle, a new bug: the
    signature may change with the world size, where another module is the first wrong) and passes on T - 1,
    T > ONSET_ABOVE; and the same case with every width scaled so that each shard is even at T - 1 and at T
    ranks (``_widened``) does not say otherwise (it fails so at T - 1: then the shapes made the onset, not
    the group size; a known bug there says nothing). Where it passes at T with even shards, the bug needs an
    uneven one (a collective below the modules over uneven shards): then the case with every width made
    uneven at T - 1 and at T alike (``_skewed``, no shard empty) must pass at T - 1 and fail so at T, else
    an uneven or empty shard made the onset. A bug that begins at a group size. Else (None, rows). rows:
    generalize.Face rows of the world sizes tried."""
    import math

    from .generalize import Face

    n = f.case.ranks
    if len(f.case.mesh_shape) != 1 or n <= ONSET_ABOVE:
        return None, []

    def fails_so(j) -> bool:
        return j is not None and j.verdict.is_finding and not j.known and j.verdict.oracle == f.verdict.oracle

    sizes = [w for w in range(ONSET_ABOVE, n + 2) if w != n]
    tried = {w: c for w in sizes if (c := _resized(f.case, w)) is not None}
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
    pair = [c for c in (_resized(wide[0], t - 1), _resized(wide[0], t)) if c is not None]
    if len(pair) < 2:
        return t, rows
    under, at = judged(pair)
    rows += [_row(dim, t - 1, under, f.signature), _row(dim, t, at, f.signature)]
    if fails_so(under) or at.verdict.status != "pass":
        return (None if fails_so(under) else t), rows
    # it needs an uneven shard at T (a collective over uneven shards): the onset is still the group size's
    # where, every shard uneven at T - 1 and at T alike (``_skewed``), it passes at T - 1 and fails at T
    skew = _skewed(f.case, t - 1, t)
    pair = [c for c in (_resized(skew[0], t - 1), _resized(skew[0], t)) if c is not None] if skew else []
    if len(pair) < 2:
        return None, rows
    under, at = judged(pair)
    dim = f"world size, widths x{skew[1]} + 1 (every shard uneven)"
    rows += [_row(dim, t - 1, under, f.signature), _row(dim, t, at, f.signature)]
    return (t if under.verdict.status == "pass" and fails_so(at) else None), rows


def _row(dimension: str, w: int, j, sig: str):
    """A generalize.Face row: what the case gave at ``w`` ranks."""
    from .generalize import Face

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
    import math

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
    import math

    widths = _widths(case)
    if widths is None:
        return None
    k = math.lcm(a, b)
    if max(widths) * k + 1 > WIDE_MAX:
        return None
    skewed = _rewidth(case, lambda w: w * k + 1)
    return (skewed, k) if skewed is not None else None


def _resized(case, w: int):
    """``case`` (1-D) on a 1-D mesh of ``w`` ranks, or None where it cannot be."""
    from ..case import Case

    try:
        c = Case.from_dict(_projected(case.to_dict(), (0,), [w]))
        c.check_world()
        return c
    except Exception:
        return None


def _rewrite(out: Path, f) -> None:
    """``f``'s files as ``f`` says now (its case, verdict, script), whatever the session wrote."""
    put_finding(out, f)


def fold_one_bug(findings: list, onsets: dict, out: Path, progress=None) -> dict:
    """One bug, one file: findings of one target and oracle that begin at the
    same group size (``onsets``, see _onset: least at T ranks on a 1-D mesh,
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
        simulation = json.loads((out / f"{owner.signature}.json").read_text()).get("simulation") or {}
        owner.faces = sorted(set(owner.faces) | {s for m in rest for s in [m.signature, *m.faces]} - {owner.signature})
        simulation["folded"] = [  # each face's own case and what real processes said of it
            {"signature": m.signature, "onset": t, "case": json.loads(m.case.to_json()), "summary": m.summary,
             "simulation": json.loads((out / f"{m.signature}.json").read_text()).get("simulation")} for m in rest]
        amend_finding(out, owner.signature, faces=owner.faces, simulation=simulation)
        for m in rest:
            folded[m.signature] = owner.signature
            drop_finding(out, m.signature)
            print(f"fuzzshard: {m.signature}: another face of finding {owner.signature} (both begin at {t} ranks on a "
                  f"1-D mesh, passing on {t - 1}: a group size, not their shapes), folded into it", file=progress)
    return folded


def _started(options, size: int, placed: bool = False):
    """A pool of ``size`` workers made from ``options`` (pool/options.py), started."""
    from ..pool.runner import Pool

    return Pool(size, options=options, placed=placed).start()


def start_simulated(options, size: int | None = None):
    """A simulated pool (LocalTensorMode workers) for the driver's own checks, side by side where it can."""
    n = size or max(1, min(2, os.cpu_count() or 1))
    return _started(options.simulated(True), n, placed=True)


def _judge_for_real(case, options, known) -> tuple:
    """``case`` judged on fresh real gloo processes, as many as its ranks: (the judgement, the environment,
    what the finding's file records of the real run)."""
    from .judge import judge
    from .record import environment, summary

    pool = _started(options.simulated(False), case.ranks)  # real gloo processes
    try:
        j = judge(pool, case, known)
        env = environment(pool.info, pool.options.backend, pool.options.device)
    finally:
        pool.close()
    real = {"signature": j.signature, "status": j.verdict.status, "world_size": case.ranks, "known": j.known,
            "seconds": round(j.seconds, 3)}
    if j.verdict.is_finding:
        real["summary"] = summary(j.verdict)
    return j, env, real


def _confirm_set_aside(set_aside: dict, out: Path, options, result: dict, progress) -> None:
    from .record import load_known, summary

    known = load_known()
    limits = out / LIMITS
    for sig, (case, verdict, why, hits) in sorted(set_aside.items()):
        w = case.ranks
        result["set_aside"].append(sig)
        data = {"signature": sig, "summary": summary(verdict), "case": json.loads(case.to_json()),
                "verdict": verdict.to_dict(), "stage": "set aside unshrunk", "hits": hits}
        if w > REAL_MAX:  # only the world size is shrunk: to the largest 1-D world <= REAL_MAX that fails the same
            smaller = _real_sized(case, sig, options)
            if smaller is None:
                data["simulation"] = {"status": f"LocalTensor's own error ({why}); {SIMULATED_ONLY}: {w} ranks, and "
                                                f"no 1-D world of <= {REAL_MAX} ranks fails the same way simulated"}
                keep_apart(out, LIMITS, sig, data)
                result["limits"].append(sig)
                print(f"fuzzshard: {sig}: LocalTensor's own error, {SIMULATED_ONLY} ({w} ranks; none of <= {REAL_MAX} "
                      f"fails the same way) -> {limits}/{sig}.json", file=progress)
                continue
            data.update(removed=[f"world size {w} -> {smaller.ranks}"], case=json.loads(smaller.to_json()))
            case, w = smaller, smaller.ranks
        print(f"fuzzshard: {sig}: LocalTensor's own error, {hits} case(s); its smallest on {w} real gloo processes",
              file=progress, flush=True)
        j, env, real = _judge_for_real(case, options, known)
        if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
            # a finding already written (this session's, shrunk and confirmed: e.g. replicas that diverged, which a
            # later .item() or float(loss) of them turns into LocalTensor's own error): one more case of it, kept as is
            result.setdefault("met", {})[sig] = j.signature
            print(f"fuzzshard: {sig}: real processes give {j.signature}, a finding already in {out} (its file kept)",
                  file=progress)
            continue
        if j.verdict.is_finding and not j.known:  # a real finding: the same signature, or a real bug of its own
            f = _write_real(out, case, j, env, "confirmed on real process groups" if j.signature == sig else
                            f"found on real process groups through a simulated case that ended in LocalTensor's "
                            f"own error ({sig}: {why}); not shrunk", real)
            if j.signature == sig:
                result["confirmed"].append(sig)
            result["found"].append(f)
            print(f"fuzzshard: {sig}: real processes give {'the same' if j.signature == sig else 'a NEW finding'} "
                  f"({j.signature}) -> {out}/{j.signature}.json", file=progress)
            continue
        data["simulation"] = {"status": f"LocalTensor limitation, recognised up front ({why}): not shrunk; "
                                        f"not reproduced on real process groups", "real": real}
        keep_apart(out, LIMITS, sig, data)
        result["limits"].append(sig)
        print(f"fuzzshard: {sig}: not a finding: real processes give {j.label}{' (known)' if j.known else ''} "
              f"-> {limits}/{sig}.json (a LocalTensor limitation)", file=progress)


def _write_real(out: Path, case, j, env: dict, status: str, real: dict):
    """OUT/<the real run's signature>.json + .py: what real processes gave for a simulated case."""
    from .record import Finding

    f = Finding(j.signature, case, j.verdict, environment=env, stage=Stage.CONFIRMED)
    put_finding(out, f, simulation={"status": status, "real": real})
    return f


def _real_sized(case, sig: str, options):
    """``case`` on the largest 1-D world of at most REAL_MAX ranks (reduce.py's world edits) that still gives
    ``sig`` simulated, or None: what a set-aside case larger than this machine's real runs is checked as."""
    from ..case import Case
    from .judge import judge
    from .reduce import _world_edits

    tries = []
    for what, data in _world_edits(json.loads(case.to_json())):
        if data is not None and what.startswith("world size") and data["world_size"] <= REAL_MAX:
            try:
                tries.append(Case.from_dict(data))
            except Exception:  # an edit the case's options cannot take: not tried
                continue
    tries.sort(key=lambda c: -c.ranks)
    pool = _started(options.simulated(True), 1)
    try:
        return next((c for c in tries if judge(pool, c).signature == sig), None)
    finally:
        pool.close()


