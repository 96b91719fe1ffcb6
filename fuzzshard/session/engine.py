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

Nothing found is lost, every finding is 1-minimal, and the search ends in time:
  - *shrinking*: each case Hypothesis shrinks a new finding to goes to the
    book (``accept``; its final replay: ``shrunk_to``), which rewrites the
    file; a round that found something searches and shrinks for
    ``hypothesis_shrink`` seconds at most (a third of ``shrink_budget``; a
    hang, which is not reduced, the whole of it), then ends with its
    smallest cases;
  - *reducing*: right after that round (not at the session's end), the book
    makes the round's findings 1-minimal (reduce.py: ``reduce_round``)
    within ``shrink_budget``, then confirms them fresh (``settle``); a later
    case no smaller than a settled finding is counted, not shrunk again. The
    reduction is never cut by ``duration``: a round the duration ended is
    reduced past it, for ``shrink_budget`` at most (``overrun``);
  - *time*: ``duration`` bounds the search; the session runs past it by its
    last round's reduction (at most ``shrink_budget``) and its ``grace``, a
    tenth of the duration (at least ``GRACE_FLOOR``: a last case, the
    confirmations);
  - *hangs*: once cases of a kind (target, ranks, checkpoint or not) have
    passed, each case runs under a timeout derived from the slowest of them
    (``SEARCH_TIMEOUT_FACTOR`` times it, ``SHRINK_TIMEOUT_FACTOR`` while a
    hang shrinks): a hang under it is provisional, written at once as a file
    that says so, and confirmed by a run at the full timeout in fresh
    workers (or as much of it as the session has left);
  - *spread*: a timed session's rounds draw by what it has covered so far
    (schedule.py: the least covered cells get more of each round);
  - *stop*: ``request_stop()`` (a signal) ends the session after the case
    that is running; the files already hold every finding seen.
"""
from __future__ import annotations

import collections
import json
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from ..targets import get as target_class
from ..kernel.dropout import dropout_coverage
from ..findings.record import Finding, load_known, summary
from ..findings.judge import judge_many
from ..findings.life import FindingBook
from ..pool.runner import Pool, PoolError
from .options import Draws, SessionOptions
from .schedule import Scheduler
from ..verdict import Verdict

try:
    BaseExceptionGroup  # noqa: B018 (a builtin from Python 3.11 on)
except NameError:  # Python 3.10: the backport, which Hypothesis already needs there
    from exceptiongroup import BaseExceptionGroup

SHRINK_TIMEOUT_FACTOR = 5.0  # a case shrinking a hang may take this many times the slowest passing case like it
SEARCH_TIMEOUT_FACTOR = 3.0  # ... a case searching, this many times
SHRINK_TIMEOUT_FLOOR = 10.0  # ... and never less than this many seconds
SEARCH_TIMEOUT_FLOOR = 15.0  # ... searching: a case of shapes torch has not seen yet may take a while on a busy machine
PASSES_TO_DERIVE = 3  # passing cases of a kind before its own slowest is the measure (before: the slowest of all)
# ... and before that many passed in all, once one has: a hang is seen past this many times the slowest passing
# case, never under this many seconds (a plant or bug met by a round's first cases is not held for --case-timeout)
EARLY_TIMEOUT_FACTOR = 10.0
EARLY_TIMEOUT_FLOOR = 30.0
GRACE_FRACTION = 0.1  # a --duration session may run over by this fraction of it (confirmations included) ...
GRACE_FLOOR = 20.0  # ... or, a session shorter than 200 s, by this many seconds (a last case, a confirmation)


class _RoundOver(KeyboardInterrupt):
    """Ends a Hypothesis run at once. A KeyboardInterrupt because that is what
    Hypothesis lets through without saving the example as a failure."""


class FindingError(Exception):
    """Raised inside the Hypothesis test for a new finding (one subclass per signature)."""


_CLASSES: dict[str, type] = {}


def _case_key(case_json: str) -> bytes:
    return hashlib.blake2b(case_json.encode(), digest_size=16).digest()


def finding_class(sig: str) -> type:
    if sig not in _CLASSES:
        _CLASSES[sig] = type(f"Finding[{sig}]", (FindingError,), {})
    return _CLASSES[sig]


@dataclass
class Stats:
    cases: int = 0
    valid: int = 0
    invalid: int = 0
    repeats: int = 0  # cases drawn again in the session: answered with their verdict, not run
    cut: int = 0  # cases the session's end cut short (not judged)
    internal_errors: int = 0
    contaminated: int = 0  # new signatures a fresh run did not confirm, after other cases in the warm workers
    unsteady: int = 0  # new signatures a fresh run did not confirm, with nothing run before them either
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
    # title -> cell -> passing cases: what they covered of their targets' own options (Spec.coverage)
    passed_coverage: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    started: float = field(default_factory=time.monotonic)
    seconds_in_cases: float = 0.0
    timings: collections.Counter = field(default_factory=collections.Counter)

    def rate(self) -> float:
        return self.cases / max(time.monotonic() - self.started, 1e-9)


@dataclass
class _Round:
    found_at: float | None = None  # when this round raised its first finding (Hypothesis's shrink counts from here)
    pending: set = field(default_factory=set)
    valid_before: int = 0  # the session's valid cases when the round began
    hang: bool = False  # a hang is shrinking: cases run under a derived timeout


class Session:
    """A fuzz session (the module's docstring). What a kind of session changes, it says through these, a
    subclass's class attributes or the constructor's arguments (soak.SoakSession, simulate.SimulatedSession):
      - ``book_class``: what keeps the session's findings from first sight to their files: FindingBook, a
        subclass (a simulated session's SimulatedBook), or any callable taking FindingBook's arguments (a
        soak cell's SoakBook with its ``origin``); the constructor's ``book_class`` wins over the class's;
      - ``fallback_db``: the directory database under OUT (that a redis database also writes);
      - ``log`` and ``procs``: OUT/cells/NAME.jsonl, a line per case (``on_case``), and the processes the
        session's ranks run in."""
    fallback_db = ".hypothesis"  # the directory database under OUT that a redis database also writes
    book_class: Callable[..., FindingBook] = FindingBook

    def __init__(self, pool: Pool, draws: Draws, options: SessionOptions = SessionOptions(), known: dict | None = None,
                 progress=None, book_class: Callable[..., FindingBook] | None = None):
        """``draws``: what the session draws (targets, world sizes, the opt-in families); ``options``: its bounds
        and places (session/options.py); ``known``: the known findings (None: the known list's)."""
        self.pool, self.draws, self.options = pool, draws, options
        # (read off the class, never bound: a plain function a subclass names is called as it is)
        self.book_class = book_class if book_class is not None else type(self).book_class
        self.targets = list(draws.targets)
        self.out = Path(options.out)
        self.findings_dir = Path(options.findings_dir or options.out)
        self.world_sizes = list(draws.world_sizes)
        self.max_examples, self.duration, self.seed = options.max_examples, options.duration, options.seed
        self.shrink_budget = options.budget()
        self.hypothesis_shrink = options.hypothesis_bound()  # a round that found something: searching, shrinking
        self._reducing_until: float | None = None  # while a round's findings are reduced: the end of their budget
        self.device = draws.device
        self.progress = progress = progress or sys.stderr  # when called, not imported (pytest swaps stderr)
        self.database = options.database if options.database is not None else str(self.out / ".hypothesis")
        self.stats = Stats()
        self.stop_reason: str | None = None
        self._failing: dict[str, tuple] = {}  # case JSON -> (signature, verdict) of new findings run
        # a case run before with no new finding -> whether it was invalid: Hypothesis draws the same case again
        # (a weighted choice's copies, its mutations; 16% of a minute's fsdp2 cases), and a case is
        # deterministic, so its verdict is the one it had (keyed by a digest: a soak draws many)
        self._ran: dict[bytes, bool] = {}
        self._pass_seconds: dict[tuple, float] = {}  # (target, ranks, checkpoint) -> slowest passing case
        self._passes: collections.Counter = collections.Counter()  # (target, ranks, checkpoint) -> passing cases
        self.schedule = Scheduler()  # what the session has covered, and what its next rounds draw
        self._last_print = 0.0
        self._deadline: float | None = None
        self.elapsed = 0.0  # the session's length, confirmations included
        self.plugins = list(options.plugins)  # --plugin files: recorded, so replay loads them
        # cases drawn together and run side by side (at most): 1 draws and runs one at a time
        self.pack = pack_size(pool, self.world_sizes) if options.pack is None else options.pack
        self.book = self.book_class(
            pool, self.out, self.stats, findings_dir=self.findings_dir, known=load_known() if known is None else known,
            progress=progress, optimizer_names=draws.strategy_kwargs().get("optimizer_names"), plugins=self.plugins,
            pack=self.pack, shrink_budget=self.shrink_budget, variant_timeout=self._derived_timeout)
        self.book.tick = self._report_progress  # progress lines while a reduction runs (no case of the search does)

    # what the summary reads (cli/fuzz.py): the book's
    @property
    def findings(self) -> dict[str, Finding]:
        return self.book.findings

    @property
    def contaminated(self) -> list[dict]:
        return self.book.contaminated

    @property
    def unsteady(self) -> list[dict]:
        return self.book.unsteady

    @property
    def known(self) -> dict:
        return self.book.known

    @property
    def matcher(self):
        return self.book.matcher

    # -- the session -------------------------------------------------------
    def run(self) -> list[Finding]:
        self.out.mkdir(parents=True, exist_ok=True)
        # the session's clock started with it (its known list read, its book made): the end is counted from there
        self._deadline = self.stats.started + self.duration if self.duration else None
        # confirmations and reduction start no later than half-way into the grace: what is then in flight ends in it
        self.book.until = self._deadline + 0.5 * self.grace() if self._deadline is not None else None
        rnd = 0
        while not self._stopped():
            for target in self.targets:
                if self._stopped():
                    break
                n = self.max_examples if not self._deadline else 25
                found = self._run_round(target, n, self.seed + rnd, reuse=rnd == 0, pin=self._steer(target))
                self._settle(found)
                self.book.catch_up()
            rnd += 1
            if not self._deadline:
                break
        self._report_progress(force=True)
        if self._deadline and self.stats.valid:
            print(self.schedule.table(), file=self.progress, flush=True)
        self.book.finish()
        self.elapsed = time.monotonic() - self.stats.started
        return list(self.findings.values())

    def request_stop(self, reason: str) -> None:
        """End after the case that is running (a signal handler calls this)."""
        self.stop_reason = self.stop_reason or reason
        self.book.stopped = True

    def grace(self) -> float:
        """How far past ``duration`` (and its last round's reduction) the session may run to finish a case
        and confirm its findings."""
        return max(GRACE_FRACTION * (self.duration or 0.0), GRACE_FLOOR)

    def overrun(self) -> float:
        """How far past ``duration`` the session may run at most: its last round's reduction (the shrink
        budget) and its grace. Reduction is never cut by the duration: a finding met in the last second
        gets its whole budget; a session whose last round found nothing ends within the grace."""
        return self.shrink_budget + self.grace()

    def _settle(self, rnd: _Round) -> None:
        """Right after a round: its findings made 1-minimal (the book's ``reduce_round``) within the shrink
        budget, past the duration if need be (``overrun``), then confirmed fresh and rewritten (``settle``).
        A stopped session leaves its files as they are."""
        if not rnd.pending or self.stop_reason is not None:
            return
        self._reducing_until = time.monotonic() + self.shrink_budget
        try:
            self.book.reduce_round(rnd.pending, self._reducing_until)
        finally:
            self._reducing_until = None
        if self._deadline is not None:  # past the duration: its confirmations start no later than half the grace on
            self.book.until = max(self.book.until, time.monotonic() + 0.5 * self.grace())
        self.book.settle(rnd.pending)

    def _stopped(self) -> bool:
        return self.stop_reason is not None or (self._deadline is not None and time.monotonic() >= self._deadline)

    def _round_over(self, rnd: _Round) -> bool:
        """Stopped, out of time, or Hypothesis has shrunk the round's findings for ``hypothesis_shrink``; a
        hang, which the reducer leaves as it is (each edit could cost a timeout), for the whole shrink budget."""
        bound = self.shrink_budget if rnd.hang else self.hypothesis_shrink
        return self._stopped() or (rnd.found_at is not None and time.monotonic() >= rnd.found_at + bound)

    def _steer(self, target: str) -> dict:
        """What the next round of a timed session draws (schedule.py): every cell of optimizer x implementation,
        world size x checkpoint (kind x the world size it loads at), mesh and dtype stays possible, and the
        least covered so far get the most of the round. (Round-robin pins of one optimizer x implementation per
        round, before, starved the other corners: 468 of ~900 cases of one session went to fused AdamW.)
        Shrinking is unchanged: the weights are fixed for the round, which is one Hypothesis run."""
        if not self._deadline:
            return {}
        return self.schedule.steer(target, self.world_sizes, self.draws.strategy_kwargs())

    def _run_round(self, target: str, n: int, seed: int, reuse: bool = True, pin: dict | None = None) -> _Round:
        """One Hypothesis run over ``target``; ``reuse``: replay the example
        database's failures first (a target's first round: later ones would
        only shrink them again); ``pin``: strategy arguments this round holds fixed.
        Returns the round: what it found (``pending``) and when (``found_at``)."""
        import fuzzshard.strategies as fst

        strategy = fst.cases(target=target, world_sizes=self.world_sizes, device=self.device,
                             **{**self.draws.strategy_kwargs(), **(pin or {})})
        if self.pack > 1:  # cases that run side by side: Hypothesis draws and shrinks them as one example
            strategy = st.lists(strategy, min_size=1, max_size=self.pack)
        rnd = _Round(valid_before=self.stats.valid)

        def body(drawn):
            cases = {}  # JSON -> case: the pack's cases, each once
            for case in drawn if self.pack > 1 else [drawn]:
                cases.setdefault(case.to_json(), case)
            digest = {key: _case_key(key) for key in cases}
            again = {key for key in cases if digest[key] in self._ran}
            new = {key: case for key, case in cases.items() if key not in self._failing and key not in again}
            self.stats.repeats += len(again)
            if new and self._round_over(rnd):
                raise _RoundOver  # out of time, or stopped: end the round now, its findings are on disk
            if new and self.pack > 1 and not rnd.pending and self.stats.valid - rnd.valid_before >= n:
                raise _RoundOver  # a round's cases, not its packs, are what max_examples counts
            ran = dict(zip(new, self._run_cases(list(new.values()), rnd)))
            for key, (sig, verdict) in ran.items():
                if sig is None and verdict is not None:  # not cut short by the session's end
                    self._ran[digest[key]] = verdict.status == "invalid"
            # a finding or a case cut short is not in _ran: not invalid
            invalid = bool(ran or again) and all(self._ran.get(digest[key], False) for key in [*ran, *again])
            raised = None
            for key, case in cases.items():
                if key in again:
                    continue
                if key in ran:
                    sig, verdict = ran[key]
                    if sig is None or not self.book.accept(sig, case, verdict):
                        continue
                    self._failing[key] = (sig, verdict)
                else:  # run before (Hypothesis replays its minimal example): same verdict
                    sig, verdict = self._failing[key]
                    if self.book.again(sig):  # an earlier round's case of a finding settled since: not shrunk again
                        continue
                    if current_build_context().is_final:
                        self.book.shrunk_to(sig, case, verdict)
                rnd.pending.add(sig)
                rnd.found_at = rnd.found_at or time.monotonic()
                rnd.hang = rnd.hang or oracles.hangs(verdict)
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
        return rnd

    def _database(self):
        if not isinstance(self.database, str):
            return self.database  # an ExampleDatabase a caller made
        from .database import open_database

        self.database = open_database(self.database, str(self.out / self.fallback_db), self.progress)
        return self.database

    # OUT/cells/NAME.jsonl: a line per case run, what ``fuzzshard report`` reads (a soak cell's, a fuzz session's)
    log: Path | None = None
    procs = 1  # the processes the session's ranks run in (a soak under torchrun: more than one)

    def on_case(self, case, verdict: Verdict, sig: str | None) -> None:
        """Called once per case run (``sig``: its finding's signature, known or new): its line in ``log``."""
        if self.log is None:
            return
        from .caselog import case_line

        line = case_line(case, verdict, sig, known=bool(sig and sig in self.known), procs=self.procs)
        with open(self.log, "a") as f:  # one short line per write: O_APPEND keeps lines whole
            f.write(json.dumps(line) + "\n")

    def _run_cases(self, cases: list, rnd: _Round) -> list[tuple[str | None, Verdict | None]]:
        """Per case, run side by side: (signature of a new finding or None, verdict; None: cut short by the
        session's end)."""
        timeouts = [self._timeout(c, rnd) for c in cases]
        end = self._end_limit()  # never past the session's end: a case cut there is no verdict
        cut = [end is not None and end < (t or self.pool.case_timeout) for t in timeouts]
        timeouts = [min(t or self.pool.case_timeout, end) if c else t for t, c in zip(timeouts, cut)]
        shrinking = [t if rnd.hang else None for t in timeouts]  # what the summary counts: limits while a hang shrank
        return [self._tally(c, j, t, k) for c, j, t, k in
                zip(cases, judge_many(self.pool, cases, self.known, timeouts), shrinking, cut)]

    def _end_limit(self) -> float | None:
        """Seconds left until the session's end, its grace included (None: no end)."""
        if self._deadline is None:
            return None
        return max(1.0, self._deadline + self.grace() - time.monotonic())

    def _tally(self, case, j, timeout: float | None, cut: bool = False) -> tuple[str | None, Verdict | None]:
        st, v = self.stats, j.verdict
        st.cases += 1
        if not j.ran:  # a known hang: counted, not waited out again
            st.known[j.signature] += 1
            self.schedule.record(case, valid=True, known=True)
            self.on_case(case, v, j.signature)
            return None, v
        if cut and oracles.hangs(v):  # the session's end cut it short: no verdict
            st.cut += 1
            return None, None
        self.schedule.record(case, valid=v.status != "invalid", known=j.known, verdict=v)
        if timeout is not None:
            st.derived_timeouts += 1
            st.derived_timeout = timeout
        st.per_target[case.target] += 1
        st.seconds_in_cases += j.seconds
        for k, t in j.timings.items():
            st.timings[k] += t
        self._report_progress()
        if v.status == "invalid":
            st.invalid += 1
            self.on_case(case, v, None)
            return None, v
        st.valid += 1
        if v.status == "error":
            st.internal_errors += 1
            self.book.report_internal(case, v)
            self.on_case(case, v, None)
            return None, v
        if not v.is_finding:
            st.passed_by_optimizer[case.optim.name] += 1
            st.passed_by_implementation[case.optim.name, case.optim.implementation] += 1
            coverage = target_class(case.target).spec.coverage
            for title, cells in (coverage(case) if coverage else {}).items():
                st.passed_coverage[title].update(cells)
            from ..kernel.ac import ac_coverage  # every target's activation checkpointing

            for title, cells in ac_coverage(case).items():
                st.passed_coverage[title].update(cells)
            for title, cells in dropout_coverage(case).items():  # every target's dropout (kernel/dropout.py)
                st.passed_coverage[title].update(cells)
            tie = target_class(case.target).spec.tie
            if tie and tie(case):  # how the target sharded a tied weight (Spec.tie)
                st.passed_coverage["tied weights"].update({f"{case.target} {tie(case)}"})
            size = (case.target, case.ranks, bool(case.checkpoint))
            self._pass_seconds[size] = max(self._pass_seconds.get(size, 0.0), j.seconds)
            self._passes[size] += 1
            self.on_case(case, v, None)
            return None, v
        self.on_case(case, v, j.signature)
        return self.book.new_signature(j), v

    def _timeout(self, case, rnd: _Round) -> float | None:
        """A limit derived from the passing cases: a hang is seen within seconds of the slowest passing
        case of its kind, not after the whole --case-timeout (it is provisional until a run at the full
        timeout in fresh workers confirms it); while a hang shrinks, a longer one."""
        if rnd.hang:
            limit = self._derived_timeout(case, SHRINK_TIMEOUT_FACTOR)
        elif sum(self._passes.values()) < PASSES_TO_DERIVE:  # None before any passed: the full timeout
            limit = self._derived_timeout(case, EARLY_TIMEOUT_FACTOR)
            limit = max(EARLY_TIMEOUT_FLOOR, limit) if limit is not None else None
        else:
            limit = self._derived_timeout(case, SEARCH_TIMEOUT_FACTOR, PASSES_TO_DERIVE)
            limit = max(SEARCH_TIMEOUT_FLOOR, limit) if limit is not None else None
        return limit if limit is not None and limit < self.pool.case_timeout else None  # else: the full one

    def _derived_timeout(self, case, factor: float = SHRINK_TIMEOUT_FACTOR, passes: int = 1) -> float | None:
        """A limit derived from the slowest passing case of this target, size
        and kind (every size seen, if fewer than ``passes`` of this one); None before any passed.
        A finding's variants and edits run under it too: a hang there is no face of it."""
        if not self._pass_seconds:
            return None
        size = (case.target, case.ranks, bool(case.checkpoint))
        seen = self._pass_seconds[size] if self._passes[size] >= passes else max(self._pass_seconds.values())
        return max(SHRINK_TIMEOUT_FLOOR, factor * seen)

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
        states = self.book.states()  # shrinking (Hypothesis), reducing (reduce.py), 1-minimal, ...
        line = (
            f"[fuzzshard] {st.cases} cases ({st.valid} valid{self._of()}, {st.invalid} invalid) · "
            f"findings: {len(self.book.tracks)} new in {self.findings_dir}"
            + (f" ({', '.join(f'{n} {s}' for s, n in states.items())})" if states else "")
            + f", {sum(st.known.values())} known hits · {st.rate():.2f} cases/s · {_clock(elapsed)}"
        )
        reducing = self._reducing_until if states.get("reducing") else None
        if self._deadline is not None and reducing is not None and now >= self._deadline:  # the last round's reduction
            line += (f" of {_clock(self.duration)}: reducing past it, ~{_clock(max(0.0, reducing - now))} more at "
                     f"most (--shrink-budget {self.shrink_budget:.0f}s)")
        elif self.duration:  # elapsed of total, and when it ends (a last round's reduction may go past it: overrun)
            line += (f" of {_clock(self.duration)} (ends in ~{_clock(max(0.0, self.duration - elapsed))}; "
                     f"a last finding's reduction {self.shrink_budget:.0f}s past it at most)")
        elif reducing is not None:
            line += f" · reducing, ~{_clock(max(0.0, reducing - now))} more at most"
        if st.contaminated:
            line += f" · contaminated {st.contaminated}"
        if st.unsteady:
            line += f" · unsteady {st.unsteady}"
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
    if pool is None or not pool.options.placed:
        return 1
    return max(1, pool.size // min(world_sizes))


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
