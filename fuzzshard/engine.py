"""A fuzz session: Hypothesis draws Cases, the pool runs them, findings shrink.

This module is the search; what becomes of a new signature (fresh
confirmation, generalization, its files, reduction and the last
confirmation) is the FindingBook's (life.py), which the session asks.

Each distinct signature raises its own exception class, so Hypothesis shrinks
every distinct bug separately. A finding whose signature is in the
known-findings list is counted, not raised, so the session keeps looking.

No idle ranks: on a pool built for it (``Pool(placed=True)``), Hypothesis
draws a *pack* of cases per example (as many of the smallest world size as
the pool holds), and the pool runs them side by side on disjoint ranks. A pack
with a new finding raises it, and Hypothesis shrinks the pack: it drops the
other cases, then shrinks the one left. ``max_examples`` still counts cases.

Nothing found is lost, and the search ends in time:
  - *shrinking*: each case Hypothesis shrinks a new finding to goes to the
    book (``accept``; its final replay: ``shrunk_to``), which rewrites the
    file; when the search ends the book finishes every finding (``finish``);
  - *time*: ``duration`` bounds the session; a round that found something
    searches and shrinks for ``shrink_budget`` more seconds at most, then
    ends with its smallest cases. While a hang shrinks, cases run under a
    timeout derived from how long passing cases of that size took: a hang
    under it is provisional, and only a run at the full timeout puts a hang
    in a file;
  - *stop*: ``request_stop()`` (a signal) ends the session after the case
    that is running; the files already hold every finding seen.
"""
from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from .findings import Finding, load_known, summary
from .judge import judge_many
from .life import FindingBook
from .runner import Pool, PoolError

try:
    BaseExceptionGroup  # noqa: B018 (a builtin from Python 3.11 on)
except NameError:  # Python 3.10: the backport, which Hypothesis already needs there
    from exceptiongroup import BaseExceptionGroup

SHRINK_TIMEOUT_FACTOR = 5.0  # a case shrinking a hang may take this many times the slowest passing case like it
SHRINK_TIMEOUT_FLOOR = 10.0  # ... and never less than this many seconds


class _RoundOver(KeyboardInterrupt):
    """Ends a Hypothesis run at once. A KeyboardInterrupt because that is what
    Hypothesis lets through without saving the example as a failure."""


class FindingError(Exception):
    """Raised inside the Hypothesis test for a new finding (one subclass per signature)."""


_CLASSES: dict[str, type] = {}


def finding_class(sig: str) -> type:
    if sig not in _CLASSES:
        _CLASSES[sig] = type(f"Finding[{sig}]", (FindingError,), {})
    return _CLASSES[sig]


def decoder_coverage(case) -> set[str]:
    """What a decoder case covered of the TP plan: its elements' styles (heads, mlp, the
    embedding rowwise, the head colwise), sp, loss_parallel, a checkpoint; "no TP" without one."""
    opts = case.target_options
    out = {"cases"} | set((opts.get("tp") or {}).values()) | {k for k in ("sp", "loss_parallel") if opts.get(k)}
    if not opts.get("tp"):
        out.add("no TP")
    if case.checkpoint:
        out.add("checkpoint")
    return out


@dataclass
class Stats:
    cases: int = 0
    valid: int = 0
    invalid: int = 0
    internal_errors: int = 0
    contaminated: int = 0  # new signatures a fresh run did not confirm
    slow: int = 0  # provisional hangs that finished at the full timeout
    derived_timeouts: int = 0  # cases run under a timeout derived while a hang shrank
    derived_timeout: float = 0.0  # the last such timeout
    known: collections.Counter = field(default_factory=collections.Counter)
    folded: collections.Counter = field(default_factory=collections.Counter)  # finding -> hits of its other faces
    generalized: int = 0  # variant cases run to generalize findings
    reduced_runs: int = 0  # edited cases run to make findings 1-minimal
    reduce_seconds: float = 0.0
    per_target: collections.Counter = field(default_factory=collections.Counter)
    passed_by_optimizer: collections.Counter = field(default_factory=collections.Counter)  # coverage
    passed_by_implementation: collections.Counter = field(default_factory=collections.Counter)  # (name, impl)
    passed_decoder: collections.Counter = field(default_factory=collections.Counter)  # decoder cases by TP element
    started: float = field(default_factory=time.monotonic)
    seconds_in_cases: float = 0.0
    timings: collections.Counter = field(default_factory=collections.Counter)

    def rate(self) -> float:
        return self.cases / max(time.monotonic() - self.started, 1e-9)


@dataclass
class _Round:
    found_at: float | None = None  # when this round raised its first finding
    pending: set = field(default_factory=set)
    valid_before: int = 0  # the session's valid cases when the round began
    hang: bool = False  # a hang is shrinking: cases run under a derived timeout


class Session:
    fallback_db = ".hypothesis"  # the directory database under OUT that a redis database also writes

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
        database=None,
        shrink_budget: float | None = None,
        findings_dir: str | Path | None = None,
        plugins=(),
        pack: int | None = None,
    ):
        self.pool = pool
        self.targets = targets
        self.out = Path(out_dir)
        self.findings_dir = Path(findings_dir) if findings_dir else self.out
        self.world_sizes = list(world_sizes)
        self.max_examples = max_examples
        self.duration = duration
        self.shrink_budget = default_shrink_budget(duration) if shrink_budget is None else shrink_budget
        self.seed = seed
        self.device = device
        self.progress = progress
        self.strategy_kwargs = strategy_kwargs or {}
        self.database = database if database is not None else str(self.out / ".hypothesis")
        self.stats = Stats()
        self.stop_reason: str | None = None
        self._failing: dict[str, tuple] = {}  # case JSON -> (signature, verdict) of new findings run
        self._pass_seconds: dict[tuple, float] = {}  # (target, ranks, checkpoint) -> slowest passing case
        self._last_print = 0.0
        self._deadline: float | None = None
        self.elapsed = 0.0  # the session's length, confirmations included
        self.plugins = [str(Path(p).resolve()) for p in plugins]  # --plugin files: recorded, so replay loads them
        # cases drawn together and run side by side (at most): 1 draws and runs one at a time
        self.pack = pack_size(pool, self.world_sizes) if pack is None else pack
        self.book = self._new_book(
            pool, self.out, self.stats, findings_dir=self.findings_dir, known=load_known() if known is None else known,
            progress=progress, optimizer_names=self.strategy_kwargs.get("optimizer_names"), plugins=self.plugins,
            pack=self.pack, shrink_budget=self.shrink_budget, variant_timeout=self._derived_timeout)

    def _new_book(self, *args, **kwargs) -> FindingBook:
        """The session's findings from first sight to their files (a soak cell's publish into a shared folder)."""
        return FindingBook(*args, **kwargs)

    # what the summary reads (cli/fuzz.py): the book's
    @property
    def findings(self) -> dict[str, Finding]:
        return self.book.findings

    @property
    def contaminated(self) -> list[dict]:
        return self.book.contaminated

    @property
    def known(self) -> dict:
        return self.book.known

    @property
    def matcher(self):
        return self.book.matcher

    # -- the session -------------------------------------------------------
    def run(self) -> list[Finding]:
        self.out.mkdir(parents=True, exist_ok=True)
        self._deadline = time.monotonic() + self.duration if self.duration else None
        self.book.until = self._deadline + self.grace() if self._deadline is not None else None  # confirmations end there
        rnd = 0
        while not self._stopped():
            for target in self.targets:
                if self._stopped():
                    break
                n = self.max_examples if not self._deadline else 25
                self._run_round(target, n, self.seed + rnd, reuse=rnd == 0, pin=self._pin(target, rnd))
                self.book.catch_up()
            rnd += 1
            if not self._deadline:
                break
        self._report_progress(force=True)
        self.book.finish()
        self.elapsed = time.monotonic() - self.stats.started
        return list(self.findings.values())

    def request_stop(self, reason: str) -> None:
        """End after the case that is running (a signal handler calls this)."""
        self.stop_reason = self.stop_reason or reason
        self.book.stopped = True

    def grace(self) -> float:
        """How far past ``duration`` the session may run to finish a case and confirm its findings."""
        return max(0.1 * (self.duration or 0.0), self.pool.case_timeout)

    def _stopped(self) -> bool:
        return self.stop_reason is not None or (self._deadline is not None and time.monotonic() >= self._deadline)

    def _round_over(self, rnd: _Round) -> bool:
        return self._stopped() or (rnd.found_at is not None and time.monotonic() >= rnd.found_at + self.shrink_budget)

    def _pin(self, target: str, rnd: int) -> dict:
        """What round ``rnd`` of a timed session holds fixed: after a first round of free draws (which also
        replays the example database), each round draws one optimizer x implementation, in turn, starting
        at a place the seed picks (soak cells start apart). Left to itself Hypothesis piles up on the first
        few: in 6-minute dtensor sessions Adam got 350-520 passing cases and Adamax 0-2, and a bug in
        Adamax alone went unseen. Shrinking is unchanged: it happens inside a round."""
        if not self._deadline or rnd == 0:
            return {}
        from fuzzshard.strategies import NOT_ELEMENTWISE, spec_of
        from fuzzshard.strategies.optimizers import default_optimizers, implementations

        names = list(self.strategy_kwargs.get("optimizer_names") or default_optimizers())
        if spec_of(target).elementwise_only:
            names = [n for n in names if n not in NOT_ELEMENTWISE]
        turns = [(n, impl) for n in names for impl in implementations(n)]
        if len(turns) < 2:
            return {}
        name, impl = turns[(self.seed + rnd - 1) % len(turns)]
        return {"optimizer_names": [name], "implementation": impl}

    def _run_round(self, target: str, n: int, seed: int, reuse: bool = True, pin: dict | None = None) -> None:
        """One Hypothesis run over ``target``; ``reuse``: replay the example
        database's failures first (a target's first round: later ones would
        only shrink them again); ``pin``: strategy arguments this round holds fixed."""
        import fuzzshard.strategies as fst

        strategy = fst.cases(target=target, world_sizes=self.world_sizes, device=self.device,
                             **{**self.strategy_kwargs, **(pin or {})})
        if self.pack > 1:  # cases that run side by side: Hypothesis draws and shrinks them as one example
            strategy = st.lists(strategy, min_size=1, max_size=self.pack)
        rnd = _Round(valid_before=self.stats.valid)

        def body(drawn):
            cases = {}  # JSON -> case: the pack's cases, each once
            for case in drawn if self.pack > 1 else [drawn]:
                cases.setdefault(case.to_json(), case)
            new = {key: case for key, case in cases.items() if key not in self._failing}
            if new and self._round_over(rnd):
                raise _RoundOver  # out of time, or stopped: end the round now, its findings are on disk
            if new and self.pack > 1 and not rnd.pending and self.stats.valid - rnd.valid_before >= n:
                raise _RoundOver  # a round's cases, not its packs, are what max_examples counts
            ran = dict(zip(new, self._run_cases(list(new.values()), rnd)))
            invalid = bool(ran) and all(v["status"] == "invalid" for _, v in ran.values())
            raised = None
            for key, case in cases.items():
                if key in ran:
                    sig, verdict = ran[key]
                    if sig is None or not self.book.accept(sig, case, verdict):
                        continue
                    self._failing[key] = (sig, verdict)
                else:  # run before (Hypothesis replays its minimal example): same verdict
                    sig, verdict = self._failing[key]
                    if current_build_context().is_final:
                        self.book.shrunk_to(sig, case, verdict)
                rnd.pending.add(sig)
                rnd.found_at = rnd.found_at or time.monotonic()
                rnd.hang = rnd.hang or verdict.get("oracle") == "hang"
                raised = raised or (sig, verdict)  # the first drives shrinking; the others are on disk, confirmed
            if raised is None and invalid:
                reject()
            if raised is not None:
                # one raise statement: Hypothesis tells bugs apart by exception type *and* the line that raised
                raise finding_class(raised[0])(summary(raised[1]))

        body._hypothesis_internal_add_digest = target.encode()  # one database key per target (read from the inner function)
        # the seed before the settings: hypothesis.seed() on its own turns the example database off
        test = hseed(seed)(given(strategy)(body))
        test = settings(
            max_examples=n,
            deadline=None,
            database=self._database(),
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, *[Phase.reuse] * reuse, Phase.generate, Phase.shrink],
            report_multiple_bugs=True,
            print_blob=False,
        )(test)
        try:
            test()
        except (FindingError, _RoundOver):
            pass
        except BaseExceptionGroup as group:
            _, rest = group.split(FindingError)
            if rest is not None:
                raise _pool_error(rest) or rest
        except Exception as e:  # hypothesis.errors.FlakyFailure and friends
            if not _only_findings(e):
                raise _pool_error(e) or e

    def _database(self):
        if not isinstance(self.database, str):
            return self.database  # an ExampleDatabase a caller made
        from .database import open_database

        self.database = open_database(self.database, str(self.out / self.fallback_db), self.progress)
        return self.database

    def on_case(self, case, verdict: dict, sig: str | None) -> None:
        """Called once per case run (``sig``: its finding's signature, known or
        new); a soak logs it here."""

    def _run_cases(self, cases: list, rnd: _Round) -> list[tuple[str | None, dict]]:
        """Per case, run side by side: (signature of a new finding or None, verdict)."""
        timeouts = [self._timeout(c, rnd) for c in cases]
        return [self._tally(c, j, t) for c, j, t in zip(cases, judge_many(self.pool, cases, self.known, timeouts),
                                                         timeouts)]

    def _tally(self, case, j, timeout: float | None) -> tuple[str | None, dict]:
        st, v = self.stats, j.verdict
        st.cases += 1
        if not j.ran:  # a known hang: counted, not waited out again
            st.known[j.signature] += 1
            self.on_case(case, v, j.signature)
            return None, v
        if timeout is not None:
            st.derived_timeouts += 1
            st.derived_timeout = timeout
        st.per_target[case.target] += 1
        st.seconds_in_cases += j.seconds
        for k, t in j.timings.items():
            st.timings[k] += t
        self._report_progress()
        if v["status"] == "invalid":
            st.invalid += 1
            self.on_case(case, v, None)
            return None, v
        st.valid += 1
        if v["status"] == "error":
            st.internal_errors += 1
            self.book.report_internal(case, v)
            self.on_case(case, v, None)
            return None, v
        if v["status"] != "finding":
            st.passed_by_optimizer[case.optim.name] += 1
            st.passed_by_implementation[case.optim.name, case.optim.implementation] += 1
            if case.model.factory == "decoder":
                st.passed_decoder.update(decoder_coverage(case))
            size = (case.target, case.ranks, bool(case.checkpoint))
            self._pass_seconds[size] = max(self._pass_seconds.get(size, 0.0), j.seconds)
            self.on_case(case, v, None)
            return None, v
        self.on_case(case, v, j.signature)
        return self.book.new_signature(j), v

    def _timeout(self, case, rnd: _Round) -> float | None:
        """While a hang shrinks: a limit derived from the passing cases."""
        return self._derived_timeout(case) if rnd.hang else None

    def _derived_timeout(self, case) -> float | None:
        """A limit derived from the slowest passing case of this target, size
        and kind (every size seen, if none of this one); None before any passed.
        A finding's variants and edits run under it too: a hang there is no face of it."""
        if not self._pass_seconds:
            return None
        seen = self._pass_seconds.get((case.target, case.ranks, bool(case.checkpoint)), max(self._pass_seconds.values()))
        return max(SHRINK_TIMEOUT_FLOOR, SHRINK_TIMEOUT_FACTOR * seen)

    def _of(self) -> str:
        """ " of N" where a --max-examples session's end is a count: max_examples valid cases per target
        (each round that finds something also shrinks it, which may take more cases)."""
        total = 0 if self.duration or not self.max_examples else self.max_examples * len(self.targets)
        return f" of {total}" if self.stats.valid < total else ""  # past it: shrinking what was found

    def _report_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_print < 5.0:
            return
        self._last_print = now
        st = self.stats
        elapsed = now - st.started
        shrinking = self.book.shrinking()
        line = (
            f"[fuzzshard] {st.cases} cases ({st.valid} valid{self._of()}, {st.invalid} invalid) · "
            f"findings: {len(self.book.tracks)} new in {self.findings_dir}"
            + (f" ({shrinking} shrinking)" if shrinking else "")
            + f", {sum(st.known.values())} known hits · {st.rate():.2f} cases/s · {_clock(elapsed)}"
        )
        if self.duration:  # elapsed of total, and when it ends (shrinking and confirmations fit in its grace)
            line += f" of {_clock(self.duration)} (ends in ~{_clock(max(0.0, self.duration - elapsed))})"
        if st.contaminated:
            line += f" · contaminated {st.contaminated}"
        if self.pool.restarts:
            line += (f" · pool restarts {self.pool.restarts} ({self.pool.stuck_seconds:.0f}s waiting for stuck ranks, "
                     f"{self.pool.restart_seconds:.0f}s restarting)")
        print(line, file=self.progress, flush=True)


def _clock(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on."""
    m, sec = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m:02d}:{sec:02d}"


def pack_size(pool, world_sizes) -> int:
    """How many cases a session draws together: as many of the smallest world
    size as the pool holds side by side, on a pool built for it (``placed``);
    otherwise 1, and a session draws what it always drew."""
    if pool is None or not pool.options.get("placed"):
        return 1
    return max(1, pool.size // min(world_sizes))


def default_shrink_budget(duration: float | None) -> float:
    """A round that found something gets this long to finish and shrink:
    a quarter of the session (at least 30 s), never more than 5 minutes
    (Hypothesis's own limit)."""
    return 300.0 if not duration else min(300.0, max(30.0, 0.25 * duration))


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
