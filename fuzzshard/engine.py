"""A fuzz session: Hypothesis draws Cases, the pool runs them, findings shrink.

Each distinct signature raises its own exception class, so Hypothesis shrinks
every distinct bug separately. Hypothesis replays each minimal example once
more at the end (``is_final``); that run records the minimal case. A finding
whose signature is in the known-findings list is counted, not raised, so the
session keeps looking for new bugs. Every new finding is re-run once before
it is reported (the determinism oracle): a verdict that changes is flaky.
"""
from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hseed
from hypothesis.control import current_build_context
from hypothesis.database import DirectoryBasedExampleDatabase

from . import repro
from .findings import Finding, environment, load_known, signature, summary, triggered, write_finding
from .runner import Pool, PoolError


class FindingError(Exception):
    """Raised inside the Hypothesis test for a new finding (one subclass per signature)."""


_CLASSES: dict[str, type] = {}


def finding_class(sig: str) -> type:
    if sig not in _CLASSES:
        _CLASSES[sig] = type(f"Finding[{sig}]", (FindingError,), {})
    return _CLASSES[sig]


@dataclass
class Stats:
    cases: int = 0
    valid: int = 0
    invalid: int = 0
    internal_errors: int = 0
    known: collections.Counter = field(default_factory=collections.Counter)
    per_target: collections.Counter = field(default_factory=collections.Counter)
    passed_by_optimizer: collections.Counter = field(default_factory=collections.Counter)  # coverage
    started: float = field(default_factory=time.monotonic)
    seconds_in_cases: float = 0.0
    timings: collections.Counter = field(default_factory=collections.Counter)

    def rate(self) -> float:
        return self.cases / max(time.monotonic() - self.started, 1e-9)


class Session:
    def __init__(
        self,
        pool: Pool,
        targets: list[str],
        out_dir: str | Path,
        world_sizes=(1, 2, 3, 4),
        max_examples: int | None = 100,
        duration: float | None = None,
        seed: int = 0,
        device: str = "cpu",
        known: dict | None = None,
        progress=sys.stderr,
        strategy_kwargs: dict | None = None,
        database: str | None = None,
    ):
        self.pool = pool
        self.targets = targets
        self.out = Path(out_dir)
        self.world_sizes = list(world_sizes)
        self.max_examples = max_examples
        self.duration = duration
        self.seed = seed
        self.device = device
        self.known = load_known() if known is None else known
        self.progress = progress
        self.strategy_kwargs = strategy_kwargs or {}
        self.database = database or str(self.out / ".hypothesis")
        self.stats = Stats()
        self.findings: dict[str, Finding] = {}
        self.flaky: list[str] = []
        self._minimal: dict[str, tuple] = {}  # sig -> the shrunk (case, verdict)
        self._seen: dict[str, tuple] = {}  # sig -> first (case, verdict), if it never shrank
        self._last_print = 0.0
        self._deadline = None

    # -- the session -------------------------------------------------------
    def run(self) -> list[Finding]:
        self.out.mkdir(parents=True, exist_ok=True)
        self._deadline = time.monotonic() + self.duration if self.duration else None
        rnd = 0
        while True:
            for target in self.targets:
                if self._time_up():
                    break
                n = self.max_examples if not self._deadline else 25
                self._run_round(target, n, self.seed + rnd)
            rnd += 1
            if not self._deadline or self._time_up():
                break
        self._report_progress(force=True)
        self._finish()
        return list(self.findings.values())

    def _time_up(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _run_round(self, target: str, n: int, seed: int) -> None:
        import fuzzshard.strategies as fst

        strategy = fst.cases(target=target, world_sizes=self.world_sizes, device=self.device, **self.strategy_kwargs)
        pending: set = set()  # signatures raised this round: never skip while one shrinks

        def body(case):
            if self._time_up() and not pending:
                return  # out of time: let this round end quickly
            sig, verdict = self._run_case(case)
            if sig is None:
                return
            pending.add(sig)
            self._seen.setdefault(sig, (case, verdict))
            if current_build_context().is_final:
                self._minimal[sig] = (case, verdict)
            raise finding_class(sig)(summary(verdict))

        test = given(strategy)(body)
        test._hypothesis_internal_add_digest = target.encode()  # one database key per target
        test = settings(
            max_examples=n,
            deadline=None,
            database=_database(self.database),
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
            report_multiple_bugs=True,
            print_blob=False,
        )(test)
        test = hseed(seed)(test)
        try:
            test()
        except FindingError:
            pass
        except BaseExceptionGroup as group:
            _, rest = group.split(FindingError)
            if rest is not None:
                raise _pool_error(rest) or rest
        except Exception as e:  # hypothesis.errors.FlakyFailure and friends
            if not _only_findings(e):
                raise _pool_error(e) or e

    def on_case(self, case, verdict: dict, sig: str | None) -> None:
        """Called once per case run (``sig``: its finding's signature, known or
        new); a soak logs it here."""

    def _run_case(self, case) -> tuple[str | None, dict]:
        """(signature of a new finding or None, verdict); rejects invalid cases."""
        hang = triggered(case, self.known)
        if hang:  # a known hang: count it, do not wait out the timeout again
            self.stats.cases += 1
            self.stats.known[hang] += 1
            v = {"status": "finding", "oracle": "hang", "known_trigger": hang}
            self.on_case(case, v, hang)
            return None, v
        result = self.pool.run(case)
        st, v = self.stats, result.verdict
        st.cases += 1
        st.per_target[case.target] += 1
        st.seconds_in_cases += result.seconds
        for k, t in result.timings.items():
            st.timings[k] += t
        self._report_progress()
        if v["status"] == "invalid":
            st.invalid += 1
            self.on_case(case, v, None)
            reject()
        st.valid += 1
        if v["status"] == "error":
            st.internal_errors += 1
            print(f"\nfuzzshard internal error (not a finding): {v.get('error')}\n{v.get('traceback', '')}", file=self.progress)
            self.on_case(case, v, None)
            return None, v
        if v["status"] != "finding":
            st.passed_by_optimizer[case.optim.name] += 1
            self.on_case(case, v, None)
            return None, v
        v = localized(self.pool, case, v)
        sig = signature(case, v)
        self.on_case(case, v, sig)
        if sig in self.known:
            st.known[sig] += 1
            return None, v
        return sig, v

    # -- after the search --------------------------------------------------
    def _finish(self) -> None:
        for sig in sorted(self._seen):
            f = self._final(sig)
            write_finding(self.out, f, repro.script(f.case, summary(f.verdict), f.environment))
            self.findings[sig] = f

    def _final(self, sig: str) -> Finding:
        """The finding of ``sig``: its smallest case, run once more (determinism)."""
        env = environment(self.pool.info, self.pool.options["backend"])
        case, verdict = self._minimal.get(sig, self._seen[sig])
        again = localized(self.pool, case, self.pool.run(case).verdict)  # determinism: the same verdict twice
        deterministic = again.get("status") == "finding" and signature(case, again) == sig
        if not deterministic:
            self.flaky.append(sig)
        return Finding(sig, case, verdict, deterministic=deterministic, environment=env)

    def _report_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_print < 5.0:
            return
        self._last_print = now
        st = self.stats
        elapsed = now - st.started
        line = (
            f"[fuzzshard] {st.cases} cases ({st.valid} valid, {st.invalid} invalid) · "
            f"findings: {len(self._seen)} new, {sum(st.known.values())} known hits · "
            f"{st.rate():.2f} cases/s · {int(elapsed // 60):02d}:{int(elapsed % 60):02d}"
        )
        if self.pool.restarts:
            line += f" · pool restarts {self.pool.restarts}"
        print(line, file=self.progress, flush=True)


def _database(where: str):
    """A directory, or a redis:// URL (needs the redis package)."""
    if where.startswith("redis://"):
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(redis.Redis.from_url(where))
    return DirectoryBasedExampleDatabase(where)


def localized(pool, case, verdict: dict) -> dict:
    """A loss or grad divergence is re-run recording per-module activations, so
    its signature names the first diverging module, not a whole model."""
    if verdict.get("oracle") == "parity" and verdict["first"]["quantity"] in ("loss", "grad"):
        again = pool.run(case, localize=True).verdict
        if again.get("oracle") == "parity":
            return again
    return verdict


def _pool_error(e: BaseException) -> PoolError | None:
    """The PoolError inside what Hypothesis raised, if any: a pool that broke
    (a lost rank of a cell spanning nodes) is no failing example; callers see it bare."""
    if isinstance(e, PoolError):
        return e
    return next((x for sub in getattr(e, "exceptions", ()) if (x := _pool_error(sub))), None)


def _only_findings(e: BaseException) -> bool:
    """A Hypothesis flaky-failure wrapping only our findings still counts as findings."""
    inner = getattr(e, "exceptions", None)
    return bool(inner) and all(isinstance(x, FindingError) or _only_findings(x) for x in inner)
