"""Typed verdicts: what one case came to, as the oracles record it.

The JSON on disk (finding files, the known list, repro scripts' output) stays
the dict it always was; these types read it and write it back unchanged
(``Verdict.from_dict(d).to_dict() == d``), so code can say ``v.first.fqn``
instead of ``v["first"]["fqn"]``. Standard library only: the kernel's repro
scripts may carry them. Keys a type does not name ride along in ``extra``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

STATUSES = ("pass", "finding", "invalid", "error")


class _Record:
    """A dict on disk as a dataclass: its named keys as fields, the rest in
    ``extra``; ``keys`` remembers which named keys the dict had (None is a
    value too), so writing it back gives the same dict."""

    @classmethod
    def from_dict(cls, d: dict):
        names = _names(cls)
        return cls(**{k: d[k] for k in names if k in d}, extra={k: v for k, v in d.items() if k not in names},
                   keys=tuple(k for k in names if k in d))

    def to_dict(self) -> dict:
        def kept(k: str) -> bool:  # read from a dict: the keys it had; built in code: the fields set
            return k in self.keys if self.keys is not None else getattr(self, k) is not None

        return {**{k: getattr(self, k) for k in _names(type(self)) if kept(k)}, **self.extra}


def _names(cls) -> list[str]:
    return [f.name for f in fields(cls) if f.name not in ("extra", "keys")]


@dataclass
class Mismatch(_Record):
    """One compared quantity that differs: ``quantity`` (loss, grad, param,
    state.NAME, group, ...) of ``fqn`` after ``step``, ``detail`` in words;
    the numbers (``max_abs``, ``tolerance``, ...) in ``extra``."""
    quantity: str
    fqn: str
    step: int
    detail: str
    extra: dict = field(default_factory=dict)
    keys: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class ErrorRecord(_Record):
    """An exception (or a death, a hang) as a verdict holds it: its ``type``
    and ``message``; ``phase``, ``traceback``, ``text`` or ``log`` where the
    oracle recorded them."""
    type: str
    message: str
    phase: str | None = None
    traceback: str | None = None
    extra: dict = field(default_factory=dict)
    keys: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class Verdict(_Record):
    status: str  # one of STATUSES
    oracle: str | None = None  # which oracle found it (findings.ORACLES), for a finding
    first: Mismatch | None = None  # parity and checkpoint: the first mismatch ...
    mismatches: list[Mismatch] | None = None  # ... and all of them (as many as recorded)
    error: ErrorRecord | str | None = None  # error_parity, crash, hang; a bare string for status "error"
    rank: int | None = None  # the rank that reported it
    extra: dict = field(default_factory=dict)  # count, stuck_ranks, where, reason, ...
    keys: tuple | None = field(default=None, repr=False, compare=False)

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
        return super().from_dict(d)

    def to_dict(self) -> dict:
        out = super().to_dict()
        for key in ("first", "error"):
            if hasattr(out.get(key), "to_dict"):
                out[key] = out[key].to_dict()
        if out.get("mismatches") is not None:
            out["mismatches"] = [m.to_dict() for m in out["mismatches"]]
        return out

