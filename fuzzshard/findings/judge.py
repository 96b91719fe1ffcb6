"""One case, judged: run it on the pool, name the module behind a loss or
grad divergence, sign the finding, and say whether it is a known torch
finding. A fuzz session, `replay`, `known --check`, the pytest plugin and
ci/add_known.py all judge through here, so they can never disagree."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from .record import known_signature, signature, triggered
from ..verdict import ErrorRecord, Verdict, failure, finding


@dataclass
class Judgement:
    verdict: Verdict
    signature: str | None = None  # a finding's
    known: bool = False  # a known torch finding on this case's device
    seconds: float = 0.0  # the run, as the pool timed it
    timings: dict = field(default_factory=dict)
    ran: bool = True  # False: a known hang's trigger matched, nothing ran

    @property
    def label(self) -> str:
        """The verdict in one word: its signature, or its status."""
        return self.signature or self.verdict.status


def judge(pool, case, known: dict | None = None, timeout: float | None = None) -> Judgement:
    """``known``: the known-findings list (a matching hang trigger is counted
    without running the case: it would cost the whole timeout); ``timeout``: a
    shorter limit than the pool's (see Pool.run)."""
    return judge_many(pool, [case], known, [timeout])[0]


def judge_many(pool, cases: list, known: dict | None = None, timeouts: list | None = None) -> list[Judgement]:
    """judge() for cases run side by side (Pool.run_many), in order; a
    divergence is localized afterwards, on its own."""
    known = known or {}
    timeouts = timeouts or [None] * len(cases)
    out: list = [None] * len(cases)
    run = []
    for i, case in enumerate(cases):
        hang = triggered(case, known)
        if hang:
            out[i] = Judgement(Verdict.from_dict(finding("hang", known_trigger=hang)), hang, True, ran=False)
        else:
            run.append(i)
    for i, result in zip(run, pool.run_many([cases[i] for i in run], [timeouts[i] for i in run])):
        out[i] = _signed(pool, cases[i], result, known, timeouts[i])
    return out


def _signed(pool, case, result, known: dict, timeout: float | None) -> Judgement:
    verdict = result.verdict
    if verdict.is_finding and (why := internal_error(verdict)):
        verdict = Verdict.from_dict(failure(why, verdict.error_record.traceback))
    if not verdict.is_finding:
        return Judgement(verdict, seconds=result.seconds, timings=result.timings)
    verdict = localized(pool, case, verdict, timeout)
    sig = signature(case, verdict)
    as_known = known_signature(sig, case, known)  # a plugin target's may be a built-in target's known bug
    return Judgement(verdict, as_known or sig, as_known is not None, result.seconds, result.timings)


def label(case, verdict: Verdict) -> str:
    """A recorded verdict in one word, as Judgement.label."""
    return signature(case, verdict) if verdict.is_finding else verdict.status


def localized(pool, case, verdict: Verdict, timeout: float | None = None) -> Verdict:
    """A loss or grad divergence is re-run recording per-module activations, so
    its signature names the first diverging module, not a whole model."""
    localize = oracles.of(verdict).localize
    if localize and localize(verdict):
        again = pool.run(case, localize=True, timeout=timeout).verdict
        if again.oracle == verdict.oracle:
            return again
    return verdict


_PACKAGE = str(Path(__file__).resolve().parent.parent) + "/"
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
# what Python raises for a mistake in the code that raised it (a name or an attribute that is not there,
# a call with the wrong arguments, an import that fails): torch's own errors reach Python as RuntimeError,
# ValueError, IndexError, ... from its C++ even when the innermost Python frame is fuzzshard's, and the
# kernel's deliberate checks of what torch left behind are AssertionError subclasses (zero.ReplicasDiverged)
_CODE_ERRORS = ("AttributeError", "NameError", "UnboundLocalError", "ImportError", "ModuleNotFoundError",
                "TypeError", "SyntaxError")


def internal_error(verdict: Verdict) -> str | None:
    """Why an error verdict is fuzzshard's own fault, not torch's (None: it is a finding): a
    programming error whose innermost frame is in fuzzshard's package (say an API this torch does
    not have: "type object 'Shard' has no attribute 'local_shard_size_and_offset'")."""
    err = verdict.error
    if not oracles.raised(verdict) or not isinstance(err, ErrorRecord) or err.type not in _CODE_ERRORS:
        return None
    frames = _FRAME.findall(err.traceback or "")
    if not frames or not str(Path(frames[-1][0]).resolve()).startswith(_PACKAGE):
        return None
    where = f"{Path(frames[-1][0]).resolve().relative_to(Path(_PACKAGE).parent)}:{frames[-1][1]} in {frames[-1][2]}"
    return f"{err.type} in fuzzshard's own code ({where}): {err.message}"
