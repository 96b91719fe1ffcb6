"""Typed verdicts: what one case came to, as the oracles record it.

The JSON on disk (finding files, the known list, repro scripts' output) stays
the dict it always was; these types read it and write it back unchanged
(``Verdict.from_dict(d).to_dict() == d``), so code can say ``v.first.fqn``
instead of ``v["first"]["fqn"]``. Standard library only: the kernel's repro
scripts may carry them. Keys a type does not name ride along in ``extra``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

STATUSES = ("pass", "finding", "invalid", "error")


@dataclass
class Mismatch:
    """One compared quantity that differs: ``quantity`` (loss, grad, param,
    state.NAME, group, ...) of ``fqn`` after ``step``, ``detail`` in words;
    the numbers (``max_abs``, ``tolerance``, ...) in ``extra``."""
    quantity: str
    fqn: str
    step: int
    detail: str
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> Mismatch:
        return _read(cls, d)

    def to_dict(self) -> dict:
        return _write(self)


@dataclass
class ErrorRecord:
    """An exception (or a death, a hang) as a verdict holds it: its ``type``
    and ``message``; ``phase``, ``traceback``, ``text`` or ``log`` where the
    oracle recorded them."""
    type: str
    message: str
    phase: str | None = None
    traceback: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> ErrorRecord:
        return _read(cls, d)

    def to_dict(self) -> dict:
        return _write(self)


@dataclass
class Verdict:
    status: str  # one of STATUSES
    oracle: str | None = None  # which oracle found it (findings.ORACLES), for a finding
    first: Mismatch | None = None  # parity and checkpoint: the first mismatch ...
    mismatches: list[Mismatch] | None = None  # ... and all of them (as many as recorded)
    error: ErrorRecord | str | None = None  # error_parity, crash, hang; a bare string for status "error"
    rank: int | None = None  # the rank that reported it
    extra: dict = field(default_factory=dict)  # count, stuck_ranks, where, reason, ...

    @property
    def is_finding(self) -> bool:
        return self.status == "finding"

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        if d.get("status") not in STATUSES:
            raise ValueError(f"a verdict's status is one of {STATUSES}, not {d.get('status')!r}")
        d = dict(d)
        if isinstance(d.get("first"), dict):
            d["first"] = Mismatch.from_dict(d["first"])
        if isinstance(d.get("mismatches"), list):
            d["mismatches"] = [Mismatch.from_dict(m) for m in d["mismatches"]]
        if isinstance(d.get("error"), dict):
            d["error"] = ErrorRecord.from_dict(d["error"])
        return _read(cls, d)

    def to_dict(self) -> dict:
        out = _write(self)
        for key in ("first", "error"):
            if hasattr(out.get(key), "to_dict"):
                out[key] = out[key].to_dict()
        if out.get("mismatches") is not None:
            out["mismatches"] = [m.to_dict() for m in out["mismatches"]]
        return out


def _read(cls, d: dict):
    names = [f.name for f in fields(cls) if f.name != "extra"]
    known = {k: d[k] for k in names if k in d}
    present = [k for k in names if k in d]
    obj = cls(**known, extra={k: v for k, v in d.items() if k not in names})
    obj._present = present  # which optional keys the dict had (None is a value too)
    return obj


def _write(obj) -> dict:
    present = getattr(obj, "_present", None)
    out: dict[str, Any] = {}
    for f in fields(obj):
        if f.name == "extra":
            continue
        value = getattr(obj, f.name)
        if (present is not None and f.name in present) or (present is None and value is not None):
            out[f.name] = value
    out.update(obj.extra)
    return out
