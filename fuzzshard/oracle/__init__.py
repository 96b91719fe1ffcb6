"""The oracles as the driver knows them: one module per way a case fails.

Each holds everything said about such a finding (its kind, signature,
summary, root-cause address, issue title, expected/actual text and suspected
torch source), so findings.py, rootcause.py and upstream.py look an oracle up
instead of branching on its name.

The comparisons themselves (what a mismatch is, the tolerances) run in the
ranks: fuzzshard/kernel/oracles.py.

oracle/NAME.py is the oracle NAME (its ``ORACLE = Oracle("NAME", ...)``), found by its file name as
targets (fuzzshard/targets.py) and script writers (fuzzshard/scriptgen) are: adding an oracle is adding
its module. Not oracles: the helpers they share (``_NOT_ORACLES``).
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import dataclass
from typing import Callable

from ..verdict import Verdict


@dataclass(frozen=True)
class Oracle:
    """One way a case fails. ``verdict`` is a finding's Verdict, ``case`` its Case."""
    name: str  # as a verdict names it ("oracle")
    kind: str  # how such a finding shows to a user: silent, raises, hang, crash
    signature: Callable  # (case, verdict) -> the finding's name, what identifies the bug (findings.signature)
    summary: Callable  # (verdict) -> one line: what diverged, where, by how much
    address: Callable  # (case, verdict) -> what identifies the torch bug behind it (rootcause.address)
    title: Callable  # (case, verdict) -> an issue title's words after "[Component] " for a new finding
    expected_actual: Callable  # (verdict) -> an issue's "Expected/actual" lines
    source: Callable  # (case, verdict) -> the torch source suspected where no root cause names one ("")
    # an issue's words, torch's and not the fuzzer's, true of any script that shows the bug (no case's numbers):
    what: Callable | None = None  # (case, verdict) -> one sentence: what happens
    expected: Callable | None = None  # (case, verdict) -> what should happen instead
    # what the session does with such a finding, said here so no other module branches on an oracle's name:
    raised: bool = False  # an exception the sharded run raised: told apart by its message template and op
    # what re-running such a case costs: "" (its time), "timeout" (a hang: the case timeout, then new
    # workers), "restart" (a crash: new workers); a costly one is not shrunk or generalized in the session
    rerun: str = ""
    # (quantity) -> the phase a compared value diverged in (parity: loss, grad, forward, backward or step;
    # checkpoint: saved, loaded, resumed); None: the oracle reports no compared values with a phase
    phase: Callable | None = None
    # (verdict) -> re-run recording per-module activations to name the module behind it (parity's loss and grads)
    localize: Callable | None = None
    # (verdict) -> its address names a module the localizer found (parity's forward and backward)
    localized: Callable | None = None
    # (case, verdict, plan) -> what a straight-line script (fuzzshard/scriptgen) of such a finding runs and
    # checks: ``plan``, scriptgen's defaults, updated with the script's mode ("checkpoint", "replica", "parity":
    # the comparison scriptgen's Writer writes out) and its steps, or why no script can (a string). None: no
    # script writes its check (the flattened kernel is its repro); a raised, crashing or hanging run's script
    # is the run up to where it stopped, written for any oracle (``raised``, ``rerun``)
    script: Callable | None = None


# the oracle modules build Oracle objects: imported once the class exists
from .common import ranks_finish  # noqa: E402
from .source import frame_source  # noqa: E402

_NOT_ORACLES = {"common", "source"}


def _found() -> dict[str, Oracle]:
    """oracle/NAME.py's ORACLE, for each NAME: checked to be an Oracle named as its file."""
    out = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if m.name in _NOT_ORACLES:
            continue
        found = getattr(importlib.import_module(f"{__name__}.{m.name}"), "ORACLE", None)
        if not (isinstance(found, Oracle) and found.name == m.name):
            raise TypeError(f"{__name__}.{m.name} must define ORACLE = Oracle({m.name!r}, ...), as every oracle does")
        out[m.name] = found
    return out


# every oracle a verdict can name (verdict.finding builds them: kernel/run.py and reference.py parity
# and error_parity ones, checkpoint ones from checkpoint.py's mismatches, the runner hang and crash ones,
# run.py replica ones from gather.py's replica comparison)
ORACLES = _found()


def _unknown_summary(verdict: Verdict) -> str:
    return json.dumps(verdict.to_dict())[:300]


# a verdict naming no oracle above (an old or hand-made file): named and shown by what it says
UNKNOWN = Oracle(
    "", "?",
    signature=lambda case, v: f"{case.target}.{v.oracle or 'unknown'}",
    summary=_unknown_summary,
    address=lambda case, v: v.oracle or "?",
    title=lambda case, v: _unknown_summary(v),
    expected_actual=lambda v: ranks_finish(v, _unknown_summary(v)),
    source=lambda case, v: frame_source(v),
    what=lambda case, v: "The sharded run does not behave like the same model trained without sharding.",
    expected=lambda case, v: "the sharded run behaves like the same model trained without sharding",
)


def raised(verdict: Verdict) -> bool:
    """Whether the finding is an exception the sharded run raised (error_parity's)."""
    return of(verdict).raised


def hangs(verdict: Verdict) -> bool:
    """Whether re-running it runs to the case timeout (a hang)."""
    return of(verdict).rerun == "timeout"


def costly(verdict: Verdict) -> bool:
    """Whether re-running it costs a timeout or new workers (a hang, a crash)."""
    return bool(of(verdict).rerun)


def get(name: str) -> Oracle | None:
    """The oracle a verdict names ``name``, or None."""
    return ORACLES.get(name)


def of(verdict: Verdict) -> Oracle:
    """The oracle behind ``verdict`` (UNKNOWN for a name none has)."""
    return ORACLES.get(verdict.oracle, UNKNOWN)


def checks(case, verdict: Verdict | None) -> Oracle:
    """The oracle whose check a straight-line script of ``case`` writes (its ``script``): the verdict's; for a
    case and not a finding (no verdict, or one naming no oracle), what the case's own run checks: the round
    trip where it checkpoints, else parity at every step."""
    if verdict is not None and verdict.oracle:
        return of(verdict)
    return ORACLES["checkpoint" if case.checkpoint else "parity"]
