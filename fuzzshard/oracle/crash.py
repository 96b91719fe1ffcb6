"""The crash oracle: a rank died (a signal, an abort) while the case ran;
the runner reports the signal and where the lowest dead rank was."""
from __future__ import annotations

from . import Oracle
from ..verdict import Verdict
from .common import ranks_finish, slug, torch_calls, where
from .source import frame_source


def signature(case, verdict: Verdict) -> str:
    """The signal, and where the lowest dead rank died: a crash elsewhere is another bug."""
    return f"{case.target}.crash.{slug(verdict.error_record.type or 'Crash')}" + where(verdict)


def summary(verdict: Verdict) -> str:
    return f"crash: {verdict.error_record.type}: ranks {verdict.extra.get('dead_ranks')} died"


def address(case, verdict: Verdict) -> str:
    """The signal and the lowest dead rank's place (kernel function:torch function)."""
    at = verdict.extra.get("where") or {}
    return f"crash ({verdict.error_record.type or '?'}) at {at[min(at)] if at else 'an unknown place'}"


def _happens(verdict: Verdict) -> str:
    """"a rank is killed by SIGABRT (rank 0 in `all_gather_single`)": the signal and the torch call it was in."""
    at = torch_calls(verdict)
    how = verdict.error_record.type or "killed by a signal"
    return f"a rank is {how[:1].lower()}{how[1:]}" + (f" ({at})" if at else "")


def what(case, verdict: Verdict) -> str:
    return f"A{_happens(verdict)[1:]}, where the same model trains without sharding."


ORACLE = Oracle("crash", "crash", signature, summary, address,
                title=lambda case, v: _happens(v),
                expected_actual=lambda v: ranks_finish(v, _happens(v)),
                # the stack faulthandler dumped for the crash: innermost frame first
                source=lambda case, v: frame_source(v, innermost_first=True),
                what=what, expected=lambda case, v: "every rank finishes, as the same model trains without sharding",
                rerun="restart")
