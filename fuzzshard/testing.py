"""For users' own Hypothesis properties: run a case on the pool and fail the
test on a new finding, reject it when it is invalid, pass known findings.
A new signature is confirmed once in fresh workers, by the run a fuzz session
confirms with (life.rerun): a verdict that changes there is a fuzzshard fault
(contaminated), not a finding."""
from __future__ import annotations

import os

import pytest
from hypothesis import reject

from .findings.record import Finding, environment, load_known, summary
from .findings.judge import judge
from .findings.files import put_finding
from .findings.life import rerun
from .verdict import Status, Verdict

# where a failing example's files go (the pytest plugin's --fuzzshard-out sets it): the same
# <signature>.json + .py a fuzz session writes; each smaller example of it rewrites them
OUT_DIR = os.environ.get("FUZZSHARD_OUT", "fuzzshard-findings")

_KNOWN = None
_CONFIRMED: set[str] = set()  # signatures a fresh run has given already


class Contaminated(RuntimeError):
    """A verdict the warm workers gave and fresh ones did not: state carried between cases."""


def check(pool, case, known: dict | None = None) -> Verdict:
    """Run ``case`` on ``pool``; returns the verdict of a passing (or known) case."""
    global _KNOWN
    if known is None:
        _KNOWN = load_known() if _KNOWN is None else _KNOWN
        known = _KNOWN
    if case.ranks > pool.size:
        pytest.fail(f"this case needs {case.ranks} ranks and the pool has {pool.size}: draw world sizes up to "
                    f"{pool.size}, or pass --fuzzshard-world-size {case.ranks}", pytrace=False)
    if case.refusal():  # the validity rule (Case.check) refuses it: no test, not run (a worker says so too)
        reject()
    j = judge(pool, case, known)
    if j.verdict.status == Status.INVALID:
        reject()
    if j.verdict.status == Status.ERROR:
        raise RuntimeError(f"fuzzshard could not run the case: {j.verdict.error}")
    if j.signature is None or j.known:
        return j.verdict
    if j.signature not in _CONFIRMED:
        got = rerun(pool, case).label
        if got != j.signature:
            raise Contaminated(f"{j.signature} in warm workers, {got} in fresh ones: state carried between cases "
                               "(a fuzzshard fault, not a finding)")
        _CONFIRMED.add(j.signature)
    path = _write(pool, j.signature, case, j.verdict)
    raise AssertionError(f"{j.signature}: {summary(j.verdict)}\n  -> {path}, {path.with_suffix('.py')}\n"
                         f"  replay: fuzzshard replay {path}")


def _write(pool, sig: str, case, verdict: Verdict):
    """OUT_DIR/<sig>.json + .py, as a fuzz session writes them; a smaller case of the same signature
    (Hypothesis shrinking) replaces a larger one, a larger one never a smaller."""
    f = Finding(sig, case, verdict, environment=environment(pool.info, pool.options.backend, pool.options.device))
    path, _ = put_finding(OUT_DIR, f, replace=False)  # the one writer of finding files (findings/files.py)
    return path
