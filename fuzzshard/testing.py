"""For users' own Hypothesis properties: run a case on the pool and fail the
test on a new finding, reject it when it is invalid, pass known findings.
A new signature is confirmed once in fresh workers, by the run a fuzz session
confirms with (life.rerun): a verdict that changes there is a fuzzshard fault
(contaminated), not a finding."""
from __future__ import annotations

from hypothesis import reject

from .findings import load_known, summary
from .judge import judge
from .life import rerun

_KNOWN = None
_CONFIRMED: set[str] = set()  # signatures a fresh run has given already


class Contaminated(RuntimeError):
    """A verdict the warm workers gave and fresh ones did not: state carried between cases."""


def check(pool, case, known: dict | None = None) -> dict:
    """Run ``case`` on ``pool``; returns the verdict of a passing (or known) case."""
    global _KNOWN
    if known is None:
        _KNOWN = load_known() if _KNOWN is None else _KNOWN
        known = _KNOWN
    j = judge(pool, case, known)
    if j.verdict["status"] == "invalid":
        reject()
    if j.verdict["status"] == "error":
        raise RuntimeError(f"fuzzshard could not run the case: {j.verdict.get('error')}")
    if j.signature is None or j.known:
        return j.verdict
    if j.signature not in _CONFIRMED:
        got = rerun(pool, case).label
        if got != j.signature:
            raise Contaminated(f"{j.signature} in warm workers, {got} in fresh ones: state carried between cases "
                               "(a fuzzshard fault, not a finding)")
        _CONFIRMED.add(j.signature)
    raise AssertionError(f"{j.signature}: {summary(j.verdict)}")
