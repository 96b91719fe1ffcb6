"""Typed verdicts: what one case came to, as the oracles record it.

The JSON on disk (finding files, the known list, repro scripts' output) stays
the dict it always was; these types read it and write it back unchanged
(``Verdict.from_dict(d).to_dict() == d``), so code can say ``v.first.fqn``
instead of ``v["first"]["fqn"]``. Standard library only: the kernel's repro
scripts may carry them. Keys a type does not name ride along in ``extra``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields


class Status(str, enum.Enum):
    """What a case came to (a str: written to and read from JSON as its value, equal to it)."""
    PASS = "pass"  # the sharded run behaves as the unsharded one
    FINDING = "finding"  # an oracle says it does not
    INVALID = "invalid"  # no test: the reference rejects or raises too, or a documented refusal
    ERROR = "error"  # fuzzshard itself failed (a bug here or in a setup file), not the case

    def __str__(self) -> str:
        return self.value


STATUSES = tuple(s.value for s in Status)


class _Record:
    """A dict on disk as a dataclass: its named keys as fields, the rest in
    ``extra``; ``keys`` remembers which named keys the dict had (None is a
    value too), so writing it back gives the same dict; a field set since
    (not None) is written too."""

    @classmethod
    def from_dict(cls, d: dict):
        names = _names(cls)
        return cls(**{k: d[k] for k in names if k in d}, extra={k: v for k, v in d.items() if k not in names},
                   keys=tuple(k for k in names if k in d))

    def to_dict(self) -> dict:
        def kept(k: str) -> bool:  # the fields set, and those a dict it was read from had (None or not)
            return getattr(self, k) is not None or (self.keys is not None and k in self.keys)

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
    status: Status  # (a Status's value is taken for it)
    oracle: str | None = None  # which oracle found it (findings.ORACLES), for a finding
    first: Mismatch | None = None  # parity and checkpoint: the first mismatch ...
    mismatches: list[Mismatch] | None = None  # ... and all of them (as many as recorded)
    error: ErrorRecord | str | None = None  # error_parity, crash, hang; a bare string for status "error"
    rank: int | None = None  # the rank that reported it
    # where a finding stands in its session (findings/life.py), said by the session, never by an oracle:
    timeout: float | None = None  # a hang seen under a shortened limit (seconds): provisional until re-run at the full one
    unconfirmed: bool | None = None  # no time was left to re-run it in fresh workers
    extra: dict = field(default_factory=dict)  # count, stuck_ranks, where, reason, ...
    keys: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def is_finding(self) -> bool:
        return self.status == Status.FINDING

    @property
    def error_record(self) -> ErrorRecord:
        """Its error as a record: an empty one where it has none, or only a message (status ERROR)."""
        return self.error if isinstance(self.error, ErrorRecord) else ErrorRecord("", "")

    @property
    def quantity(self) -> str:
        """What its first mismatch is of (loss, grad, param, state.NAME, ...), "" without one."""
        return self.first.quantity if self.first else ""

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
            out["mismatches"] = [m.to_dict() if hasattr(m, "to_dict") else m for m in out["mismatches"]]
        return out



# What the oracles build: every verdict a case can come to is made by one of
# these (the kernel, the runner and the worker), so its shape is said once.

def passing() -> dict:
    return Verdict(Status.PASS).to_dict()


def invalid(reason: str, error: dict | None = None) -> dict:
    """The case is no test: the reference rejects or raises too, or a documented refusal."""
    return Verdict(Status.INVALID, error=error, extra={"reason": reason}).to_dict()


def failure(message: str, traceback_text: str | None = None) -> dict:
    """fuzzshard itself failed (a bug here or in a setup file), not the case."""
    return Verdict(Status.ERROR, error=message, extra={"traceback": traceback_text} if traceback_text else {}).to_dict()


def finding(oracle: str, mismatches: list[dict] | None = None, error: dict | None = None, **extra) -> dict:
    """A finding of ``oracle`` (findings.ORACLES): its mismatches (the first,
    up to MAX_REPORTED of them and their count), or its error record."""
    if mismatches:
        return Verdict(Status.FINDING, oracle, first=mismatches[0], mismatches=mismatches[:MAX_REPORTED],
                       extra={"count": len(mismatches), **extra}).to_dict()
    return Verdict(Status.FINDING, oracle, error=error, extra=extra).to_dict()


MAX_REPORTED = 8  # mismatches a finding keeps (its count says how many there were)


def error_record(e: BaseException) -> dict:
    """An exception as a verdict holds it (ErrorRecord): type, first line of
    the message, a short text, the traceback's tail."""
    import traceback

    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)][0]
        if isinstance(inner, BaseException):
            out = error_record(inner)
            out["traceback"] = (out["traceback"] + "".join(traceback.format_exception(e)))[-4000:]
            return out
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ErrorRecord(type(e).__name__, msg[:500], traceback="".join(traceback.format_exception(e))[-4000:],
                       extra={"text": f"{type(e).__name__}: {msg[:300]}"}).to_dict()
