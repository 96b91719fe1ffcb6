"""A fuzz session: Hypothesis draws Cases, the pool runs them, findings shrink.

Each distinct signature raises its own exception class, so Hypothesis shrinks
every distinct bug separately. A finding whose signature is in the
known-findings list is counted, not raised, so the session keeps looking.

No idle ranks: on a pool built for it (``Pool(placed=True)``), Hypothesis
draws a *pack* of cases per example (as many of the smallest world size as
the pool holds), and the pool runs them side by side on disjoint ranks. A pack
with a new finding raises it, and Hypothesis shrinks the pack: it drops the
other cases, then shrinks the one left. ``max_examples`` still counts cases.

A finding is a bug a user can trust, and nothing found is lost:
  - *fresh confirmation*: a new signature's case runs once more in worker
    processes that have run nothing else (``Pool.fresh``). The same signature
    there makes it a finding, written at once (``OUT/<sig>.json`` + ``.py``).
    Another verdict means something carried over from earlier cases in the
    warm workers: a fuzzshard fault, reported as *contaminated* (both
    verdicts and what ran before it), never as a finding;
  - *shrinking*: each smaller case with that signature rewrites the file
    (stage ``shrinking``, at most every ``WRITE_EVERY`` seconds); when the
    search ends the smallest is confirmed fresh as well (stage ``confirmed``)
    or the file goes back to the last confirmed case;
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
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from . import repro
from .findings import Finding, atomic_write, environment, known_signature, load_known, summary, write_finding
from .generalize import generalize
from .reduce import reduce as reduce_case
from .judge import judge, judge_many, label
from .rootcause import Matcher
from .runner import Pool, PoolError

try:
    BaseExceptionGroup  # noqa: B018 (a builtin from Python 3.11 on)
except NameError:  # Python 3.10: the backport, which Hypothesis already needs there
    from exceptiongroup import BaseExceptionGroup

WRITE_EVERY = 2.0  # seconds between two rewrites of one finding's file while it shrinks
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
class _Track:
    """One new signature: the case a fresh run confirmed, the smallest seen
    (provisional hangs included), the one its file holds."""
    confirmed: tuple  # (case, verdict)
    best: tuple
    written: tuple
    last_write: float = 0.0


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
        self.known = load_known() if known is None else known
        self.matcher = Matcher(self.known)  # a new finding's probable known root cause
        self.progress = progress
        self.strategy_kwargs = strategy_kwargs or {}
        self.database = database if database is not None else str(self.out / ".hypothesis")
        self.stats = Stats()
        self.findings: dict[str, Finding] = {}
        self.contaminated: list[dict] = []
        self.stop_reason: str | None = None
        self._tracks: dict[str, _Track] = {}
        self._owner: dict[str, str] = {}  # a signature -> the finding it is a face of (one bug, one finding)
        self._tables: dict[str, list] = {}  # finding -> its generalization table (generalize.Face)
        self._generalized: dict[str, str] = {}  # finding -> the case JSON its table is of
        self._as_known: dict[str, str] = {}  # a new signature -> the known finding it is a face of
        self._removed: dict[str, list] = {}  # finding -> what the reducer took out of its case
        self._failing: dict[str, tuple] = {}  # case JSON -> (signature, verdict) of new findings run
        self._suspect: set[str] = set()  # signatures a fresh run did not confirm
        self._pass_seconds: dict[tuple, float] = {}  # (target, ranks, checkpoint) -> slowest passing case
        self._last_print = 0.0
        self._deadline: float | None = None
        self.elapsed = 0.0  # the session's length, confirmations included
        self.plugins = [str(Path(p).resolve()) for p in plugins]  # --plugin files: recorded, so replay loads them
        # cases drawn together and run side by side (at most): 1 draws and runs one at a time
        self.pack = pack_size(pool, self.world_sizes) if pack is None else pack

    # -- the session -------------------------------------------------------
    def run(self) -> list[Finding]:
        self.out.mkdir(parents=True, exist_ok=True)
        self._deadline = time.monotonic() + self.duration if self.duration else None
        rnd = 0
        while not self._stopped():
            for target in self.targets:
                if self._stopped():
                    break
                n = self.max_examples if not self._deadline else 25
                self._run_round(target, n, self.seed + rnd, reuse=rnd == 0, pin=self._pin(target, rnd))
            rnd += 1
            if not self._deadline:
                break
        self._report_progress(force=True)
        self._finish()
        self.elapsed = time.monotonic() - self.stats.started
        return list(self.findings.values())

    def request_stop(self, reason: str) -> None:
        """End after the case that is running (a signal handler calls this)."""
        self.stop_reason = self.stop_reason or reason

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
                    if sig is None or not self._accept(sig, case, verdict):
                        continue
                    self._failing[key] = (sig, verdict)
                else:  # run before (Hypothesis replays its minimal example): same verdict
                    sig, verdict = self._failing[key]
                    if current_build_context().is_final:
                        self._shrunk_to(sig, case, verdict)
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
            path = self._report_internal(case, v)
            print(f"\nfuzzshard internal error (not a finding): {v.get('error')}\n{v.get('traceback', '')}"
                  f"\n  -> {path}", file=self.progress)
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
        if j.known:
            st.known[j.signature] += 1
            return None, v
        if j.signature in self._as_known:
            st.known[self._as_known[j.signature]] += 1
            return None, v
        owner = self._owner.get(j.signature, j.signature)
        if owner != j.signature:  # another face of a finding already made: counted there, never a file of its own
            st.folded[owner] += 1
            return None, v
        return j.signature, v

    def _timeout(self, case, rnd: _Round) -> float | None:
        """While a hang shrinks: a limit derived from the slowest passing case
        of this target, size and kind (every size seen, if none of this one)."""
        if not rnd.hang or not self._pass_seconds:
            return None
        seen = self._pass_seconds.get((case.target, case.ranks, bool(case.checkpoint)), max(self._pass_seconds.values()))
        return max(SHRINK_TIMEOUT_FLOOR, SHRINK_TIMEOUT_FACTOR * seen)

    # -- a finding's life: confirmed fresh, written, shrunk, confirmed again --
    def _accept(self, sig: str, case, verdict: dict) -> bool:
        """Whether this new-signature verdict counts (and drives shrinking)."""
        track = self._tracks.get(sig)
        if track is None:
            if sig in self._suspect:  # one fresh run already said this signature is not what it seems
                self.stats.contaminated += 1
                return False
            confirmed = self._confirm(sig, case, verdict)
            if confirmed is None:
                return False
            faces = self._generalize(sig, *confirmed)
            known = next((k for s in sorted(faces) if s != sig and (k := known_signature(s, case, self.known))), None)
            if known is not None:  # a known bug in a face not recorded yet: a variant of the case fails as it
                self._known_face(sig, known, confirmed)
                return False
            owner = next((self._owner[s] for s in sorted(faces) if s in self._owner), None)
            if owner is not None:  # the same bug as a finding already made, in another face
                self._fold(owner, faces)
                self._say(f"new signature {sig}: another face of finding {owner} (it fails the same way), folded into it")
                return False
            self._owner.update({s: sig for s in faces})
            if not self._publish(sig, confirmed, first=True):
                return False  # another cell of a soak wrote it first: a known finding now
            self._tracks[sig] = _Track(confirmed, confirmed, confirmed, time.monotonic())
            probably = self.matcher.label(*confirmed[:2])
            self._say(f"new finding {sig}, confirmed in fresh workers -> {self.findings_dir / sig}.json"
                      + (f" ({probably})" if probably else ""))
            return True
        if _smaller(case, track.best[0]):
            track.best = (case, verdict)
            if not verdict.get("timeout"):  # a provisional hang never reaches the file
                self._rewrite(sig, track)
        return True

    def _generalize(self, sig: str, case, verdict: dict) -> set[str]:
        """Re-run ``case`` along the dimensions a bug may not depend on
        (generalize.py): its table is kept for the file; returns the signatures
        this one bug shows under (``sig`` among them)."""
        if verdict.get("oracle") in ("hang", "crash") or verdict.get("unconfirmed"):
            return {sig}  # named by where it stops, whatever the optimizer; each variant could cost a timeout
        names = self.strategy_kwargs.get("optimizer_names")
        table, faces = generalize(lambda cases: judge_many(self.pool, cases, self.known,
                                                           [self._variant_timeout(c) for c in cases]),
                                  case, verdict, names)
        self._tables[sig] = table
        self._generalized[sig] = case.to_json()
        self.stats.generalized += len(table)
        return faces | {sig}

    def _known_face(self, sig: str, known: str, found: tuple) -> None:
        """``sig`` is the known finding ``known`` in another face: a variant of
        its case, changed in one dimension, fails the same way under that
        signature. Counted as a known hit; its case is kept in
        OUT/known_faces/<sig>.json for ``fuzzshard known`` to record."""
        case, verdict = found
        self._as_known[sig] = known
        self.stats.known[known] += 1
        rows = [f for f in self._tables.get(sig, []) if f.signature == known]
        how = f" with {rows[0].dimension} {rows[0].value}" if rows else " (another quantity of the same run)"
        folder = self.out / "known_faces"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"signature": sig, "known": known, "root_cause": self.known[known].root_cause,
                  "generalization": [f.to_dict() for f in self._tables.get(sig, [])],
                  "verdict": verdict, "case": case.to_dict()}
        atomic_write(folder / f"{sig}.json", json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        self._say(f"new signature {sig}: the known finding {known} in another face (it fails the same way{how}; "
                  f"root cause {self.known[known].root_cause or '?'}) -> {folder / sig}.json")

    def _variant_timeout(self, case) -> float | None:
        """A variant is limited like a case that shrinks a hang: a hang there is no face of this finding."""
        if not self._pass_seconds:
            return None
        seen = self._pass_seconds.get((case.target, case.ranks, bool(case.checkpoint)), max(self._pass_seconds.values()))
        return max(SHRINK_TIMEOUT_FLOOR, SHRINK_TIMEOUT_FACTOR * seen)

    def _fold(self, owner: str, faces: set[str]) -> None:
        """``faces`` are ``owner``'s now; its file says so."""
        for s in faces:
            self._owner.setdefault(s, owner)
        track = self._tracks.get(owner)
        if track is not None:
            self._publish(owner, track.written, first=False)

    def _shrunk_to(self, sig: str, case, verdict: dict) -> None:
        """Hypothesis's final replay names its minimal example: that is the best case."""
        track = self._tracks.get(sig)
        if track is not None and not verdict.get("timeout") and case.to_json() != track.best[0].to_json():
            track.best = (case, verdict)
            self._rewrite(sig, track)

    def _confirm(self, sig: str, case, verdict: dict, fresh: bool = True) -> tuple | None:
        """(case, verdict) when fresh workers give ``sig`` too, else None
        (a contaminated verdict is reported; a provisional hang that finishes
        was only slow). At the full case timeout. ``fresh=False``: in the
        workers that confirmed the session's other findings just before (see
        _finish); a verdict that differs there is re-checked in fresh ones."""
        before = list(self.pool.history)
        if self._deadline is not None and time.monotonic() > self._deadline + self.grace():
            self._say(f"new finding {sig}: no time left to confirm it in fresh workers; written unconfirmed")
            return case, {**verdict, "unconfirmed": True}
        if fresh:
            self.pool.fresh()
        again = judge(self.pool, case)
        if not fresh and again.label != sig:
            return self._confirm(sig, case, verdict)
        got = again.label
        if got == sig:
            return case, again.verdict
        if verdict.get("timeout"):
            self.stats.slow += 1
            return None
        self.stats.contaminated += 1
        self._suspect.add(sig)
        self._report_contaminated(sig, case, verdict, again.verdict, got, before)
        return None

    def _report_contaminated(self, sig, case, warm: dict, fresh: dict, got: str, before: list) -> None:
        ran_before = [f"{c.target} W{c.ranks} {c.optim.name}: {label(c, v)}" for c, v in before[:-1]]
        record = {"signature": sig, "fresh_signature": got, "warm_verdict": warm, "fresh_verdict": fresh,
                  "ran_before_in_that_generation": ran_before, "case": case.to_dict()}
        self.contaminated.append(record)
        folder = self.out / "contaminated"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{sig}.json"
        atomic_write(path, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        self._say(f"fuzzshard internal error (contaminated, not a finding): {sig} in the warm workers, {got} in fresh "
                  f"ones; {len(ran_before)} case(s) ran before it in that generation "
                  f"({', '.join(ran_before[-3:]) or 'none'}) -> {path}")

    def _report_internal(self, case, verdict: dict) -> Path:
        """OUT/internal/<digest>.json: an error in fuzzshard's own code, with its case (kept apart: never a finding)."""
        import hashlib

        folder = self.out / "internal"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{hashlib.sha1(str(verdict.get('error')).encode()).hexdigest()[:8]}.json"
        if not path.exists():  # one file per error; the first case that met it
            atomic_write(path, json.dumps({"error": verdict.get("error"), "traceback": verdict.get("traceback"),
                                           "case": case.to_dict()}, indent=2, sort_keys=True, default=str) + "\n")
        return path

    def _rewrite(self, sig: str, track: _Track, force: bool = False) -> None:
        if track.best is track.written or track.best[1].get("timeout"):
            return
        if force or time.monotonic() - track.last_write >= WRITE_EVERY:
            self._publish(sig, track.best, first=False)
            track.written, track.last_write = track.best, time.monotonic()

    def _publish(self, sig: str, found: tuple, first: bool) -> bool:
        """Write the finding's files (whole or not at all); False: not this session's to write."""
        f = self._finding(sig, found)
        self.findings[sig] = f
        write_finding(self.findings_dir, f, repro.script(f.case, summary(f.verdict), f.environment), replace=True)
        return True

    def _finding(self, sig: str, found: tuple) -> Finding:
        case, verdict = found
        track = self._tracks.get(sig)
        confirmed = not verdict.get("unconfirmed") and (track is None or found is track.confirmed)
        stage = "confirmed" if confirmed else "unconfirmed" if verdict.get("unconfirmed") else "shrinking"
        env = environment(self.pool.info, self.pool.options["backend"], self.pool.options["device"])
        if self.plugins:
            env["plugins"] = self.plugins
        faces = sorted(s for s, o in self._owner.items() if o == sig and s != sig)
        table = [f.to_dict() for f in self._tables.get(sig, [])]
        return Finding(sig, case, {k: v for k, v in verdict.items() if k != "unconfirmed"}, deterministic=confirmed,
                       environment=env, stage=stage, faces=faces, generalization=table, removed=self._removed.get(sig, []))

    def _finish(self) -> None:
        """Confirm each finding's smallest case, in the time left; a stopped
        session leaves its files as they are. Each signature was confirmed in
        fresh workers when first seen; the smallest cases are re-run in one
        fresh generation together (one spawn, not one per finding), and one
        that does not give its signature there gets a generation of its own."""
        first = True
        for sig in sorted(self._tracks):
            if self._may_confirm():
                self._reduce(sig, self._tracks[sig])
        for sig in sorted(self._tracks):
            track = self._tracks[sig]
            if track.best is not track.confirmed and self._may_confirm():
                again = None
                if not track.best[1].get("unconfirmed"):
                    again, first = self._confirm(sig, *track.best, fresh=first), False
                if again is not None:
                    track.confirmed = track.best = again
            if self.stop_reason is None:  # the file holds the confirmed case
                track.best = track.confirmed
            self._rewrite(sig, track, force=True)
            self.findings[sig] = self._finding(sig, track.written)
        for sig in sorted(self._tracks):
            if sig in self._tracks and self._may_confirm():
                self._generalize_again(sig)

    def _reduce(self, sig: str, track: _Track) -> None:
        """Make the smallest case 1-minimal (reduce.py): each structural edit
        Hypothesis does not make (drop a layer and re-fit the widths, a group,
        a frozen param, the checkpoint; lower the world size, ...) is tried and
        kept while the case still gives ``sig``, to a fixed point, within
        ``shrink_budget``; the file is rewritten as it shrinks."""
        case, verdict = track.best
        if verdict.get("oracle") == "hang" or verdict.get("timeout") or verdict.get("unconfirmed"):
            return  # each edit could cost a timeout
        verdicts: dict[str, dict] = {}

        def keeps_bugs(cases: list) -> list[bool]:
            judged = judge_many(self.pool, cases, self.known, [self._variant_timeout(c) for c in cases])
            self.stats.reduced_runs += len(cases)
            for c, j in zip(cases, judged):
                verdicts[c.to_json()] = j.verdict
            return [j.label == sig for j in judged]

        def smaller(c) -> None:
            track.best = (c, verdicts[c.to_json()])
            self._rewrite(sig, track)

        budget = self.shrink_budget
        if self._deadline is not None:
            budget = min(budget, self._deadline + self.grace() - time.monotonic())
        started = time.monotonic()
        _, removed = reduce_case(case, budget_s=max(0.0, budget), on_smaller=smaller, keeps_bugs=keeps_bugs,
                                 batch=self.pack)
        self.stats.reduce_seconds += time.monotonic() - started
        self._removed[sig] = self._removed.get(sig, []) + removed

    def _generalize_again(self, sig: str) -> None:
        """The table of ``sig``'s smallest case, and one finding per bug: a
        finding that case's variants fail as (the same way) is a face of the
        same bug. Its signature goes into this finding's file, then its own
        files go (this one is written first: nothing found is lost)."""
        track = self._tracks[sig]
        if self._generalized.get(sig) == track.written[0].to_json():
            return
        faces = self._generalize(sig, *track.written)
        merged = sorted(s for s in faces if s in self._tracks and s != sig)
        for other in merged:
            for s, o in list(self._owner.items()):
                if o == other:
                    self._owner[s] = sig
            self._tracks.pop(other)
            self.findings.pop(other, None)
            self.stats.folded[sig] += 1
        for s in faces:
            self._owner.setdefault(s, sig)
        self._publish(sig, track.written, first=False)
        self.findings[sig] = self._finding(sig, track.written)
        for other in merged:
            self._say(f"finding {other}: another face of finding {sig} (its smallest case fails the same way there), "
                      f"folded into it")
            for suffix in (".json", ".py"):
                (self.findings_dir / f"{other}{suffix}").unlink(missing_ok=True)

    def _may_confirm(self) -> bool:
        if self.stop_reason is not None:
            return False
        return self._deadline is None or time.monotonic() < self._deadline + self.grace()

    def _say(self, text: str) -> None:
        print(text, file=self.progress, flush=True)

    def _report_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_print < 5.0:
            return
        self._last_print = now
        st = self.stats
        elapsed = now - st.started
        shrinking = sum(1 for t in self._tracks.values() if t.best is not t.confirmed)
        line = (
            f"[fuzzshard] {st.cases} cases ({st.valid} valid, {st.invalid} invalid) · "
            f"findings: {len(self._tracks)} new in {self.findings_dir}"
            + (f" ({shrinking} shrinking)" if shrinking else "")
            + f", {sum(st.known.values())} known hits · {st.rate():.2f} cases/s · {int(elapsed // 60):02d}:{int(elapsed % 60):02d}"
        )
        if st.contaminated:
            line += f" · contaminated {st.contaminated}"
        if self.pool.restarts:
            line += (f" · pool restarts {self.pool.restarts} ({self.pool.stuck_seconds:.0f}s waiting for stuck ranks, "
                     f"{self.pool.restart_seconds:.0f}s restarting)")
        print(line, file=self.progress, flush=True)


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


def _smaller(a, b) -> bool:
    return (a.ranks, len(a.to_json())) < (b.ranks, len(b.to_json()))


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
