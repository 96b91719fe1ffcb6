"""One finding per bug: a finding's case re-run along the dimensions a bug
may not depend on, as Hypothesis's explain phase does for one test.

A finding's signature names the optimizer, its implementation, the quantity
that diverged first and the checkpoint kind, so one torch bug that touches
every optimizer shows under a dozen signatures. Here the finding's case is
re-run with each of those changed, one at a time (``variants``). A variant
that fails *the same way* (``same_way``: the same oracle and phase, at the
same step, on the same params) is the same bug in another face; its
signature, and the signatures of every quantity the same run got wrong
(``faces_of``), are folded into the finding: one file, one summary line,
and a table of what it fails and passes with. A variant that fails
otherwise (other params, another step, another error) is another bug and
is left to be found on its own: two bugs stay two.

One face shows under another oracle: a case with a checkpoint is also run
up to the save alone (dimension "checkpoint": its steps after the save and
the checkpoint left out, ``up_to_the_save``), and a variant that fails
*earlier* (``earlier``: on the params the finding names) is where the
finding's bug began: the checkpoint only carried it (a replica that drifted
before the save, whose copy the save took), and the kernel named the
checkpoint's oracle because both showed at the save's step (run.py's
_replica_first) or the run raised after the load. Its signature is a face.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from ..case import Case, CaseError
from .record import signature
from ..verdict import Verdict


@dataclass(frozen=True)
class Face:
    """One variant of a finding's case and what it came to."""
    dimension: str  # "implementation", "optimizer", "dtype", "checkpoint kind", "target"
    value: str  # what the variant has there ("foreach", "Adam", "float64", "dcp", "fsdp2")
    outcome: str  # "fails" (the same way), "fails earlier" (see earlier), "passes", "invalid", "fails otherwise", "error"
    signature: str = ""  # a failing variant's

    def to_dict(self) -> dict:
        return asdict(self)


def variants(case: Case, optimizer_names=None, other_targets=()) -> list[tuple[str, str, Case]]:
    """(dimension, value, case) for each one-dimension change of ``case``
    that is still a well-formed case (the reference may still refuse it:
    that variant is then "invalid"); ``other_targets``: those it may be carried to
    (its ``kin``, or those of them the caller's pool runs)."""
    from .. import targets
    from ..strategies import NOT_ELEMENTWISE, ONLY_2D
    from ..strategies.optimizers import accepts, default_optimizers, implementations

    out = []
    name, impl = case.optim.name, case.optim.implementation
    for other in implementations(name):
        if other != impl:
            out.append(("implementation", other, _with_optimizer(case, name, other, accepts)))
    spec = targets.get(case.target).spec if case.target in targets.names() else None
    for other in optimizer_names or default_optimizers():
        if other == name or other in ONLY_2D or (spec and spec.elementwise_only and other in NOT_ELEMENTWISE):
            continue
        if impl in implementations(other):
            out.append(("optimizer", other, _with_optimizer(case, other, impl, accepts)))
    if case.model.factory == "" and case.dtype in ("float32", "float64"):
        other = "float64" if case.dtype == "float32" else "float32"
        out.append(("dtype", other, replace(case, dtype=other)))
    if case.checkpoint:  # what the case runs before the save, no more (see earlier)
        out.append(("checkpoint", UP_TO_THE_SAVE, up_to_the_save(case)))
    if case.checkpoint and spec:
        for kind in spec.checkpoint_kinds:
            if kind != case.checkpoint.kind:
                out.append(("checkpoint kind", kind, replace(case, checkpoint=replace(case.checkpoint, kind=kind))))
    for other in other_targets:
        carried = carry(case, other)
        if carried is not None:
            out.append(("target", other, carried))
    kept = []
    for dim, value, v in out:
        try:
            v.check()
        except CaseError:
            continue
        kept.append((dim, value, v))
    return kept


UP_TO_THE_SAVE = "none (its steps up to the save)"  # the checkpoint row's value


def up_to_the_save(case: Case) -> Case:
    """``case`` without its checkpoint (the reducer's "no checkpoint" edit) and without the steps after the
    save (its "drop step" edits, the last first): what the case runs before the save, and nothing after
    it that could fail first (an error in a later step would hide where the bug began)."""
    from .reduce import step_edits

    data = case.to_dict()
    while len(data["schedule"]) > max(0, data["checkpoint"]["after"]) + 1:
        last = f"drop step {len(data['schedule']) - 1}"
        data = next(new for what, new in step_edits(data) if what == last)
    data["checkpoint"] = None
    return Case.from_dict(data)


@functools.lru_cache(maxsize=None)
def kin(target: str) -> tuple[str, ...]:
    """The other built-in targets a bug of ``target`` may show on: those that
    share their known bugs (a target's ``known_as``, either way, and theirs in
    turn): dtensor, tp and fsdp2 for each other (a plugin's parallelism too)."""
    from .. import targets

    def linked(name: str) -> set:
        return set(getattr(targets.get(name), "known_as", ())) if name in targets.names() else set()

    names = set(targets.builtin()) | {target}
    links = {t: linked(t) for t in names}
    seen, todo = {target}, [target]
    while todo:
        t = todo.pop()
        for u in links.get(t, set()) | {v for v in names if t in links[v]}:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return tuple(sorted(seen & set(targets.builtin()) - {target}))


def _layout(target: str, mesh, options: dict, names) -> dict | None:
    """How ``target`` places each param on ``mesh`` under ``options`` (its Spec's ``layout``), as the dtensor
    target's placements say it ({fqn: ["R" | "S<d>"] per mesh dim}); None: not a plain layout."""
    from .. import targets

    layout = targets.get(target).spec.layout
    return None if layout is None else layout(mesh, options, names)


def _carried_options(target: str, mesh, options: dict, to: str, names) -> dict | None:
    """The options under which target ``to`` places every param as ``target`` does under ``options``
    (its defaults otherwise), or None where it cannot."""
    layout = _layout(target, mesh, options, names)
    if layout is None:
        return None
    from .. import targets

    place_as = targets.get(to).spec.place_as
    if place_as is not None:  # a target whose options are a layout (dtensor)
        return place_as(layout)
    return {} if _layout(to, mesh, {}, names) == layout else None


def carry(case: Case, to: str) -> Case | None:
    """``case`` run on target ``to`` with every param placed as before (each side of a checkpoint),
    the batch made a multiple of what ``to`` splits it into; None where ``to`` cannot place them so,
    or has not the case's checkpoint kind."""
    from .. import targets
    from ..kernel.model import param_shapes
    from .shrink_world import batch_unit

    spec = targets.get(to).spec
    ck = case.checkpoint
    if ck and ck.kind not in spec.checkpoint_kinds:
        return None
    try:
        names = list(param_shapes(case.model))
    except Exception:  # a plugin's model this driver cannot build
        return None
    options = _carried_options(case.target, case.mesh_shape, case.target_options, to, names)
    ck_options = _carried_options(case.target, ck.mesh_shape, ck.target_options, to, names) if ck else {}
    if options is None or ck_options is None:
        return None
    moved = replace(case, target=to, target_options=options,
                    checkpoint=replace(ck, target_options=ck_options) if ck else None)
    unit = batch_unit(moved.to_dict())  # a data-parallel target gives every rank an equal slice
    return replace(moved, batch=unit * -(-moved.batch // unit))


_IMPL_FLAGS = ("foreach", "fused")


def _with_optimizer(case: Case, name: str, impl: str, accepts) -> Case:
    """``case`` with optimizer ``name`` in implementation ``impl``: the
    hyperparameters it shares with the old one kept, the others torch's defaults."""
    kwargs = {k: v for k, v in case.optim.kwargs.items() if k not in _IMPL_FLAGS and accepts(name, k)}
    if accepts(name, "foreach"):
        kwargs["foreach"] = impl == "foreach"
    if impl == "fused":
        kwargs["fused"] = True
    groups = tuple(replace(g, overrides={k: v for k, v in g.overrides.items() if accepts(name, k)})
                   for g in case.groups)
    return replace(case, optim=replace(case.optim, name=name, kwargs=kwargs), groups=groups)


def _shape(verdict: Verdict) -> tuple:
    """What a failure looks like beyond the optimizer, implementation or
    checkpoint kind that surfaced it: the oracle, its phase (a step, a
    forward/backward quantity, a checkpoint's saved/loaded/resumed), the step,
    and the params that diverged there; an error's type and message."""
    oracle, first = verdict.oracle, verdict.first
    phase_of = oracles.of(verdict).phase
    if phase_of and first:
        phase = phase_of(first.quantity)
        at = [m for m in verdict.mismatches or [first] if m.step == first.step]
        return oracle, phase, first.extra.get("module"), first.step, frozenset(m.fqn for m in at)
    err = verdict.error_record
    return oracle, err.type, err.message


def same_way(a: Verdict, b: Verdict) -> bool:
    """Whether verdict ``b`` is the failure of verdict ``a`` in another face (see _shape)."""
    if not a.is_finding or not b.is_finding:
        return False
    sa, sb = _shape(a), _shape(b)
    if sa[:-1] != sb[:-1]:
        return False
    if not oracles.of(a).phase:
        return sa == sb
    # the params that diverged: the same ones (a verdict keeps its first few mismatches: then one set holds the other)
    cut = any(v.extra.get("count", 0) > len(v.mismatches or []) for v in (a, b))
    return sa[-1] == sb[-1] or (cut and (sa[-1] <= sb[-1] or sb[-1] <= sa[-1]))


def _began(verdict: Verdict) -> tuple[int, frozenset, bool] | None:
    """(step, the params that diverged there, whether the verdict kept only its first few) of a verdict
    that names what diverged; None: one that names no param (an error, a hyperparameter of no param)."""
    first = verdict.first
    if not verdict.is_finding or not first or first.step is None:
        return None
    at = frozenset(m.fqn for m in verdict.mismatches or [first] if m.step == first.step and m.fqn)
    return (first.step, at, verdict.extra.get("count", 0) > len(verdict.mismatches or [])) if at else None


def earlier(a: Verdict, b: Verdict, saved_after: int) -> bool:
    """Whether ``b``, the verdict of ``a``'s case up to its save (after step ``saved_after``:
    ``up_to_the_save``), is ``a``'s bug where it began: another finding, at a step no later than the save
    and than ``a``'s, on the params ``a`` names there (all of them; one of them where either verdict kept
    only its first few). The steps up to the save are the same run with or without the checkpoint, so
    ``b`` happened first in ``a``'s own run too: the kernel names one oracle per run, the checkpoint's
    where both show at the save's step (run.py: _replica_first) or the run raised after the load; a
    replica that drifted before the save is what the save took. A checkpoint bug of its own leaves the
    case up to its save passing (or failing on other params: not folded)."""
    if same_way(a, b):
        return False
    began_a, began_b = _began(a), _began(b)
    if began_a is None or began_b is None:
        return False
    (step_a, fqns_a, cut_a), (step_b, fqns_b, cut_b) = began_a, began_b
    if step_b > min(step_a, saved_after):
        return False
    return fqns_a <= fqns_b or ((cut_a or cut_b) and bool(fqns_a & fqns_b))


def faces_of(case: Case, verdict: Verdict) -> set[str]:
    """The signatures of every quantity this one run got wrong where it first
    diverged (an optimizer-step bug shows in the param and in each state)."""
    first = verdict.first
    if not oracles.of(verdict).phase or not first:
        return {signature(case, verdict)}
    # the same phase only: a grad bug also leaves the params after that step wrong, which is no face of it
    phase = _shape(verdict)[1]
    at = [m for m in verdict.mismatches or [first] if m.step == first.step and _shape(replace(verdict, first=m))[1] == phase]
    return {signature(case, replace(verdict, first=m)) for m in at} | {signature(case, verdict)}


def generalize(judge_many, case: Case, verdict: Verdict, optimizer_names=None,
               other_targets=()) -> tuple[list[Face], set[str]]:
    """Run every variant of ``case`` (``judge_many``: cases -> Judgements, side
    by side where the pool can); returns the table of faces and the
    signatures one bug shows under (the finding's own among them)."""
    found = variants(case, optimizer_names, other_targets)
    table, sigs = [], faces_of(case, verdict)
    for (dim, value, v), j in zip(found, judge_many([v for _, _, v in found]) if found else []):
        status = j.verdict.status
        if status != "finding":
            outcome = {"pass": "passes", "invalid": "invalid"}.get(status, "error")
            table.append(Face(dim, value, outcome))
        elif same_way(verdict, j.verdict):
            table.append(Face(dim, value, "fails", j.label))
            sigs |= faces_of(v, j.verdict) | {j.label}
        elif dim == "checkpoint" and earlier(verdict, j.verdict, case.checkpoint.after):
            table.append(Face(dim, value, "fails earlier", j.label))
            sigs |= faces_of(v, j.verdict) | {j.label}
        else:
            table.append(Face(dim, value, "fails otherwise", j.label))
    return table, sigs


def table_text(table: list[Face]) -> str:
    """The table, a line per dimension: "optimizer: fails with Adam, SGD; passes with Adagrad"."""
    lines = []
    for dim in dict.fromkeys(f.dimension for f in table):
        rows = [f for f in table if f.dimension == dim]
        parts = []
        for outcome, word in (("fails", "fails with"), ("fails earlier", "fails earlier, where it began, with"),
                              ("passes", "passes with"), ("fails otherwise", "fails otherwise with"),
                              ("invalid", "refused by the reference with"), ("error", "could not run with")):
            values = [f.value + (f" ({f.signature})" if outcome in ("fails otherwise", "fails earlier") else "")
                      for f in rows if f.outcome == outcome]
            if values:
                parts.append(f"{word} {', '.join(values)}")
        lines.append(f"{dim}: {'; '.join(parts)}")
    return "\n".join(lines)
