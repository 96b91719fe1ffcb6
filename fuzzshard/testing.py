"""For users' own Hypothesis properties: run a case on the pool and fail the
test on a new finding, reject it when it is invalid, pass known findings."""
from __future__ import annotations

from hypothesis import reject

from .findings import load_known, signature, summary, triggered

_KNOWN = None


def check(pool, case, known: dict | None = None) -> dict:
    """Run ``case`` on ``pool``; returns the verdict of a passing (or known) case."""
    global _KNOWN
    if known is None:
        _KNOWN = load_known() if _KNOWN is None else _KNOWN
        known = _KNOWN
    from .engine import localized

    hang = triggered(case, known)
    if hang:  # a known hang: do not wait out the timeout
        return {"status": "finding", "oracle": "hang", "known_trigger": hang}
    verdict = pool.run(case).verdict
    if verdict["status"] == "invalid":
        reject()
    if verdict["status"] == "error":
        raise RuntimeError(f"fuzzshard could not run the case: {verdict.get('error')}")
    if verdict["status"] == "finding":
        verdict = localized(pool, case, verdict)
    if verdict["status"] == "finding" and signature(case, verdict) not in known:
        raise AssertionError(f"{signature(case, verdict)}: {summary(verdict)}")
    return verdict
