"""The hang oracle: ranks still running when the case timeout ran out; the
runner reports where each stuck rank waits."""
from __future__ import annotations

from . import Oracle
from ..verdict import Verdict
from .common import ranks_finish, torch_calls, where
from .source import frame_source


def signature(case, verdict: Verdict) -> str:
    """Where the lowest stuck rank waits names the hang."""
    return f"{case.target}.hang" + where(verdict)


def summary(verdict: Verdict) -> str:
    return f"hang: {verdict.error_record.message}"


def address(case, verdict: Verdict) -> str:
    """Where the lowest stuck rank waits (kernel function:torch function)."""
    at = verdict.extra.get("where") or {}
    return f"hang ({verdict.error_record.type or '?'}) at {at[min(at)] if at else 'an unknown place'}"


def _happens(verdict: Verdict) -> str:
    """"the ranks hang (rank 0 in `all_reduce`, rank 1 in `all_gather`)"."""
    at = torch_calls(verdict)
    return "the ranks hang" + (f" ({at})" if at else "")


ORACLE = Oracle("hang", "hang", signature, summary, address,
                title=lambda case, v: _happens(v),
                expected_actual=lambda v: ranks_finish(v, _happens(v)),
                source=lambda case, v: frame_source(v),
                what=lambda case, v: f"T{_happens(v)[1:]}, where the same model trains without sharding.",
                expected=lambda case, v: "every rank finishes, as the same model trains without sharding",
                rerun="timeout")
