"""For users' own Hypothesis properties: run a case on the pool and fail the
test on a new finding, reject it when it is invalid, pass known findings.
A new signature is confirmed once in fresh workers, as in a fuzz session: a
verdict that changes there is a fuzzshard fault (contaminated), not a finding."""
from __future__ import annotations

from hypothesis import reject

from .findings import is_known, load_known, signature, summary, triggered

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
    from .engine import localized

    hang = triggered(case, known)
    if hang:  # a known hang: do not wait out the timeout
        return {"status": "finding", "oracle": "hang", "known_trigger": hang}
    verdict = pool.run(case).verdict
    if verdict["status"] == "invalid":
        reject()
    if verdict["status"] == "error":
        raise RuntimeError(f"fuzzshard could not run the case: {verdict.get('error')}")
    if verdict["status"] != "finding":
        return verdict
    verdict = localized(pool, case, verdict)
    sig = signature(case, verdict)
    if is_known(sig, case, known):
        return verdict
    if sig not in _CONFIRMED:
        pool.fresh()
        again = localized(pool, case, pool.run(case).verdict)
        got = signature(case, again) if again["status"] == "finding" else again["status"]
        if got != sig:
            raise Contaminated(f"{sig} in warm workers, {got} in fresh ones: state carried between cases "
                               "(a fuzzshard fault, not a finding)")
        _CONFIRMED.add(sig)
    raise AssertionError(f"{sig}: {summary(verdict)}")
