"""A finding's life, from first sight to its final file, in one place.

The search (engine.py) finds new signatures; the FindingBook here decides
what each one is and owns every finding of the session from then on. A
finding is a bug a user can trust, and nothing found is lost:
  - *fresh confirmation*: a new signature's case runs once more in worker
    processes that have run nothing else (``rerun``; Pool.fresh). The same
    signature there makes it a finding, written at once (``OUT/<sig>.json``
    + ``.py``). Another verdict means something carried over from earlier
    cases in the warm workers: a fuzzshard fault, reported as *contaminated*
    (both verdicts and what ran before it), never as a finding;
  - *known in any face*: a new error whose address comes down to one known
    root cause (rootcause.Matcher.known_hit) is a hit of that root cause, not
    a finding: counted, its case kept in ``OUT/known_faces/``;
  - *one finding per bug*: the confirmed case is re-run along the dimensions
    a bug may not depend on (onebug.py, FindingBook's base; generalize.py);
    a face of a finding made or known is folded into it;
  - *shrinking*: each smaller case with that signature rewrites the file
    (stage ``shrinking``, at most every ``WRITE_EVERY`` seconds); right
    after the round that found it (``reduce_round``) the smallest is made
    1-minimal (reduce.py, the one shrinker) in the budget the session gives,
    its file saying how far the reducer got (``reduction``), then
    (``settle``) confirmed fresh as well (stage ``confirmed``) or the file
    goes back to the last confirmed case, and generalized again. A settled
    finding met again by a case no smaller is counted, not shrunk again;
  - *real processes*, for a simulated session's findings (``confirm_on_real``,
    with the pools its caller hands in): each shrunk to its least world
    (onset.py), then confirmed on real gloo process groups, or kept apart as
    a LocalTensor limitation, or marked simulated only (real.py);
  - *writing*: every file of a finding is written through ``_write`` (its
    script: files.script_of); a soak's cells publish into one shared folder
    instead (SoakBook: the first cell wins, the others count it as known).
    Every file is put in place by files.py's writer: no other module writes
    a finding's files.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from .files import drop_finding, keep_apart, put_finding, script_of
from .record import Finding, Stage, environment, known_signature, load_finding, load_known, publish_finding
from .judge import Judgement, judge, label
from .onebug import OneBug
from .reduce import Reduction, minimize
from .rootcause import Matcher, address
from ..verdict import Verdict

WRITE_EVERY = 2.0  # seconds between two rewrites of one finding's file while it shrinks
# where a finding is in its life (Track.state): what the session's progress line counts
SHRINKING = "shrinking"  # Hypothesis shrinks it, in the round that found it (or a smaller case of it)
REDUCING = "reducing"  # the reducer (reduce.py) edits it, right after that round
MINIMAL = "1-minimal"  # reduced to a fixed point: no single edit keeps the bug
CUT = "not 1-minimal"  # the reducer's budget ran out first (its file's ``reduction`` says how far it got)
UNREDUCED = "not reduced"  # a hang, or a case no time was left to confirm: each edit could cost a timeout


def rerun(pool, case, fresh: bool = True, timeout: float | None = None) -> Judgement:
    """The confirmation run: ``case`` once more, in worker processes that have
    run nothing else (``fresh``) or in the ones there are. A fuzz session and
    the pytest plugin's check() confirm through here. ``timeout``: less than
    the pool's (a hang confirmed in the time a session has left)."""
    if fresh:
        pool.fresh()
    return judge(pool, case, timeout=timeout)


@dataclass
class Track:
    """One new signature: the case a fresh run confirmed, the smallest seen
    (provisional hangs included), the one its file holds."""
    confirmed: tuple  # (case, verdict)
    best: tuple
    written: tuple
    last_write: float = 0.0
    confirmed_removed: list = field(default_factory=list)  # what the reducer had taken out of the confirmed case
    state: str = SHRINKING  # SHRINKING, REDUCING, then MINIMAL, CUT or UNREDUCED (settled: ``settled``)
    confirmed_reduction: dict = field(default_factory=dict)  # the reduction record of the confirmed case

    @property
    def settled(self) -> bool:
        """Reduced (or not to be) and confirmed: a later case no smaller than it is met again, not shrunk again."""
        return self.state not in (SHRINKING, REDUCING)


class FindingBook(OneBug):
    """Every new finding of one session, from first sight to its final file.

    The search asks ``new_signature`` (what a judged finding is), ``accept``
    (whether a new signature's case counts: first sight or a smaller case),
    ``shrunk_to`` (Hypothesis's minimal example), then, right after the
    round that found them, ``reduce_round`` (reduce.py, within a budget
    the session gives, past its duration if need be) and ``settle``
    (confirmed fresh, rewritten, generalized again); it ends with
    ``finish``. ``until`` and ``stopped`` are the session's: past ``until``
    (its deadline plus grace, monotonic) nothing more is confirmed; a stopped
    session leaves its files as they are. ``tick`` is called as a reduction
    goes (the session's progress line)."""

    def __init__(self, pool, out: str | Path, stats, *, findings_dir: str | Path | None = None,
                 known: dict | None = None, progress=None, optimizer_names=None, plugins=(), pack: int = 1,
                 shrink_budget: float = 300.0, variant_timeout: Callable = lambda case: None):
        self.pool = pool
        self.out = Path(out)
        self.findings_dir = Path(findings_dir) if findings_dir else self.out
        self.stats = stats  # the session's Stats: the counters a finding's life adds to
        self.known = load_known() if known is None else known
        self.matcher = Matcher(self.known)  # a new finding's probable known root cause
        self.progress = progress or sys.stderr  # when called, not imported (pytest swaps stderr)
        self.optimizer_names = optimizer_names  # what generalizing may swap in
        self.plugins = list(plugins)
        self.pack = pack  # edits the reducer judges side by side
        self.shrink_budget = shrink_budget
        self.variant_timeout = variant_timeout  # case -> a limit for a variant (a hang there is no face of it)
        self.until: float | None = None
        self.stopped = False
        self.findings: dict[str, Finding] = {}
        self.contaminated: list[dict] = []
        self.unsteady: list[dict] = []  # verdicts fresh workers gave one way and fresh ones another (_report_contaminated)
        self.tracks: dict[str, Track] = {}
        self._owner: dict[str, str] = {}  # a signature -> the finding it is a face of (one bug, one finding)
        self._tables: dict[str, list] = {}  # finding -> its generalization table (generalize.Face)
        self._generalized: dict[str, str] = {}  # finding -> the case JSON its table is of
        self._as_known: dict[str, str] = {}  # a new signature -> the known finding it is a face of
        self._removed: dict[str, list] = {}  # finding -> what the reducer took out of its case
        self._reduction: dict[str, dict] = {}  # finding -> its reduction record (reduce.Reduction.record)
        self.met_again: dict[str, int] = {}  # a settled finding -> later cases that met it, no smaller (not shrunk again)
        self.tick: Callable[..., None] = lambda force=False: None  # the session's progress line (force: now)
        self._met: dict[str, dict] = {}  # finding -> another target -> a face met failing there in its own case
        self._suspect: set[str] = set()  # signatures a fresh run did not confirm
        self._unsteady: set[str] = set()  # of those, the ones with nothing run before them (_report_contaminated)

    # -- what the search asks --------------------------------------------------
    def new_signature(self, j: Judgement) -> str | None:
        """The new finding's signature a judged finding gives, or None: a hit
        of a known finding (or of a known finding's other face), or another
        face of a finding already made, counted where it belongs."""
        st = self.stats
        if j.known:
            st.known[j.signature] += 1
            return None
        if j.signature in self._as_known:
            st.known[self._as_known[j.signature]] += 1
            return None
        owner = self._owner.get(j.signature, j.signature)
        if owner != j.signature:  # another face of a finding already made: counted there, never a file of its own
            st.folded[owner] += 1
            return None
        return j.signature

    def accept(self, sig: str, case, verdict: Verdict) -> bool:
        """Whether this new-signature verdict counts (and drives shrinking)."""
        track = self.tracks.get(sig)
        if track is None:
            if sig in self._suspect:  # one fresh run already said this signature is not what it seems
                if sig in self._unsteady:
                    self.stats.unsteady += 1
                else:
                    self.stats.contaminated += 1
                return False
            hit = self.matcher.known_hit(case, verdict)
            if hit is not None:  # a known root cause in a face not recorded: counted, never a finding
                self._known_by_address(sig, hit, case, verdict)
                return False
            provisional = bool(verdict.timeout)  # a hang under a derived limit: on disk before its confirmation
            if provisional and not self._write_provisional(sig, case, verdict):
                return False
            if provisional and self.stopped:
                return False  # stopped: the file stays, provisional
            confirmed = self.confirm(sig, case, verdict)
            if confirmed is None:
                if provisional:  # it finished at the full timeout: slow, not hung
                    self._unwrite(sig)
                    self._say(f"provisional hang {sig}: finished at the full timeout in fresh workers (slow, not "
                              f"hung); its file is removed")
                return False
            # confirmed: on disk before it is generalized (its variants take a while; a stop meanwhile keeps it)
            if not self._write(sig, confirmed, first=not provisional):
                return False  # another cell of a soak wrote it first: a known finding now
            faces = self._generalize(sig, *confirmed)
            known = next((k for s in sorted(faces) if s != sig and (k := known_signature(s, case, self.known))), None)
            if known is not None:  # a known bug in a face not recorded yet: a variant of the case fails as it
                self._unwrite(sig)
                self._known_face(sig, known, confirmed)
                return False
            owner = next((self._owner[s] for s in sorted(faces) if s in self._owner), None)
            if owner is not None:  # the same bug as a finding already made, in another face
                self._unwrite(sig)
                self._fold(owner, faces)
                self._say(f"new signature {sig}: another face of finding {owner} (it fails the same way), folded into it")
                return False
            owner = self._same_error_elsewhere(sig, *confirmed[:2])
            if owner is not None:  # the same error on a kin target, met on its own: one bug
                self._unwrite(sig)
                self._fold(owner, faces)
                self._say(f"new signature {sig}: finding {owner} on another target (the same address and message: "
                          f"{address(*confirmed[:2])}), folded into it")
                return False
            self._owner.update({s: sig for s in faces})
            if faces != {sig} or self._tables.get(sig):
                self._write(sig, confirmed, first=False)  # with its faces and generalization table
            self.tracks[sig] = Track(confirmed, confirmed, confirmed, time.monotonic())
            probably = self.matcher.label(*confirmed[:2])
            how = "confirmed in fresh workers" if not confirmed[1].timeout else \
                f"hung in fresh workers too, for the {confirmed[1].timeout:.0f}s the session had left: still provisional"
            self._say(f"new finding {sig}, {how} -> {self.findings_dir / sig}.json"
                      + (f" ({probably})" if probably else ""))
            return True
        if smaller_case(case, track.best[0]):
            if track.settled:  # a smaller case than the settled one: Hypothesis shrinks it, the reducer goes on from it
                track.state = SHRINKING
                self._removed[sig] = []  # (the file keeps the confirmed case's until this one is confirmed)
            track.best = (case, verdict)
            if not verdict.timeout:  # a provisional hang never reaches the file
                self._rewrite(sig, track)
        elif self.again(sig):  # 1-minimal (or as far as its budget went) and confirmed: not shrunk all over again
            return False
        return True

    def again(self, sig: str) -> bool:
        """Whether ``sig`` is a settled finding (reduced and confirmed) met again, by a case no smaller than its
        own: then counted (``met_again``), and the search does not shrink it all over again."""
        track = self.tracks.get(sig)
        if track is None or not track.settled:
            return False
        self.met_again[sig] = self.met_again.get(sig, 0) + 1
        return True

    def shrunk_to(self, sig: str, case, verdict: Verdict) -> None:
        """Hypothesis's final replay names its minimal example: that is the best case."""
        track = self.tracks.get(sig)
        if track is not None and not track.settled and not verdict.timeout and \
                case.to_json() != track.best[0].to_json():
            track.best = (case, verdict)
            self._rewrite(sig, track)

    def shrinking(self) -> int:
        """Findings not settled yet: Hypothesis shrinks them, or the reducer."""
        return sum(1 for t in self.tracks.values() if not t.settled)

    def states(self) -> dict[str, int]:
        """Findings by where they are (SHRINKING, REDUCING, MINIMAL, CUT, UNREDUCED), in that order."""
        order = (SHRINKING, REDUCING, MINIMAL, CUT, UNREDUCED)
        counts = {s: sum(1 for t in self.tracks.values() if t.state == s) for s in order}
        return {s: n for s, n in counts.items() if n}

    def catch_up(self) -> None:
        """What others writing the same findings folder found meanwhile (a
        soak's other cells: SoakBook); nothing for a session on its own."""

    def reduce_round(self, sigs, until: float) -> None:
        """Each of ``sigs`` (a round's findings) still shrinking made 1-minimal (``_reduce``), right after
        its round, not at the session's end: they share the time left until ``until`` (monotonic; the
        session's: the round's end plus the shrink budget, past its duration if need be), each its share
        of what the ones before it left. A stopped session reduces nothing."""
        todo = [s for s in sorted(sigs) if s in self.tracks and self.tracks[s].state == SHRINKING]
        for i, sig in enumerate(todo):
            if self.stopped:
                return
            self._reduce(sig, self.tracks[sig], (until - time.monotonic()) / (len(todo) - i))

    def settle(self, sigs) -> None:
        """Each of ``sigs``'s smallest case confirmed in fresh workers, in the time left; a stopped session
        leaves its files as they are. Each signature was confirmed in fresh workers when first seen; the
        smallest cases are re-run in one fresh generation together (one spawn, not one per finding), and
        one that does not give its signature there gets a generation of its own. Then each is generalized
        again (one finding per bug) and settled: a later case no smaller is met again, not shrunk again."""
        sigs = [s for s in sorted(sigs) if s in self.tracks]
        first = True
        for sig in sigs:
            track = self.tracks[sig]
            if track.best is not track.confirmed and self._time_left():
                again = None
                if not track.best[1].unconfirmed:
                    again, first = self.confirm(sig, *track.best, fresh=first), False
                if again is not None:
                    track.confirmed = track.best = again
                    track.confirmed_removed = list(self._removed.get(sig, []))
                    track.confirmed_reduction = dict(self._reduction.get(sig, {}))
            if not self.stopped:  # the file holds the confirmed case
                if track.best is not track.confirmed:  # back to an earlier case: the reducer's later edits are not in it
                    self._removed[sig] = list(track.confirmed_removed)
                    self._reduction[sig] = dict(track.confirmed_reduction) or {
                        "minimal": False, "why": "its reduced case did not give its signature in fresh workers "
                                                 "(or no time was left to run it there): the file holds the case "
                                                 "confirmed before"}
                    track.state = MINIMAL if self._reduction[sig].get("minimal") else CUT
                track.best = track.confirmed
                if not track.settled:  # (not reduced: a hang, an unconfirmed case)
                    track.state = UNREDUCED
            if not track.best[1].timeout:  # whole, with its reduction record (a provisional hang keeps its file)
                self._write(sig, track.best, first=False)
                track.written, track.last_write = track.best, time.monotonic()
            self.findings[sig] = self._finding(sig, track.written)
        for sig in sigs:
            if sig in self.tracks and self._time_left():
                self._generalize_again(sig)

    def finish(self) -> None:
        """The end of the session: what no round reduced yet (a session driven without rounds, the pytest
        plugin's) reduced within the shrink budget and the time left, then every finding settled."""
        left = [s for s in sorted(self.tracks) if self.tracks[s].state == SHRINKING]
        if left and self._time_left():
            until = time.monotonic() + self.shrink_budget
            self.reduce_round(left, until if self.until is None else min(until, self.until))
        self.settle(sorted(self.tracks))

    # -- confirmation ----------------------------------------------------------
    def confirm(self, sig: str, case, verdict: Verdict, fresh: bool = True) -> tuple | None:
        """(case, verdict) when fresh workers give ``sig`` too, else None
        (a contaminated verdict is reported; a provisional hang that finishes
        was only slow). At the full case timeout. ``fresh=False``: in the
        workers that confirmed the session's other findings just before (see
        finish); a verdict that differs there is re-checked in fresh ones."""
        before = list(self.pool.history)
        if self.until is not None and time.monotonic() > self.until:
            self._say(f"new finding {sig}: no time left to confirm it in fresh workers; written unconfirmed")
            return case, replace(verdict, unconfirmed=True)
        limit = None  # a hang is confirmed at the full timeout, or in what the session has left of its time
        if oracles.hangs(verdict) and self.until is not None:
            left = self.until - time.monotonic()
            limit = left if left < self.pool.case_timeout else None
        again = rerun(self.pool, case, fresh, timeout=limit)
        if not fresh and again.label != sig:
            return self.confirm(sig, case, verdict)
        got = again.label
        if got == sig:
            return case, again.verdict
        if oracles.of(verdict).rerun == "restart" and again.verdict.oracle == verdict.oracle:
            # a crash that kills a rank in fresh workers too is confirmed: where the others were when it died
            # (the torch call its signature names) may differ from run to run (torch 2.9.1's pipelining abort
            # met one rank in isend, then in wait_batch_p2p); the warm run's record stays the finding's
            return case, verdict
        if verdict.timeout:
            self.stats.slow += 1
            return None
        self._suspect.add(sig)
        self._report_contaminated(sig, case, verdict, again.verdict, got, before)
        return None

    def _report_contaminated(self, sig, case, warm: Verdict, fresh: Verdict, got: str, before: list) -> None:
        """OUT/contaminated/<sig>.json: the warm workers' verdict that fresh ones do not give, after the cases
        that ran before it there. Where none did, the warm workers were as fresh as the confirmation's: nothing
        could carry over, the case's outcome varies between fresh runs (torch 2.9.1's pipelining abort: a
        crash, or the dying rank's error first), and it goes to OUT/unsteady/ instead, counted apart: not a
        finding (it does not replay as itself), not fuzzshard's fault."""
        ran_before = [f"{c.target} W{c.ranks} {c.optim.name}: {label(c, v)}" for c, v in before[:-1]]
        record = {"signature": sig, "fresh_signature": got, "warm_verdict": warm.to_dict(), "fresh_verdict": fresh.to_dict(),
                  "ran_before_in_that_generation": ran_before, "case": case.to_dict()}
        if not ran_before:
            self.stats.unsteady += 1
            self._unsteady.add(sig)
            self.unsteady.append(record)
            path = self._record("unsteady", sig, record)
            self._say(f"unsteady, not a finding: {sig} in workers that had run nothing before it, {got} in fresh "
                      f"ones (the case's outcome varies between fresh runs) -> {path}")
            return
        self.stats.contaminated += 1
        self.contaminated.append(record)
        path = self._record("contaminated", sig, record)
        self._say(f"fuzzshard internal error (contaminated, not a finding): {sig} in the warm workers, {got} in fresh "
                  f"ones; {len(ran_before)} case(s) ran before it in that generation "
                  f"({', '.join(ran_before[-3:]) or 'none'}) -> {path}")

    def report_internal(self, case, verdict: Verdict) -> Path:
        """OUT/internal/<digest>.json: an error in fuzzshard's own code, with its case (kept apart: never a finding)."""
        name = hashlib.sha1(str(verdict.error).encode()).hexdigest()[:8]
        path = self.out / "internal" / f"{name}.json"
        traceback = verdict.extra.get("traceback")
        if not path.exists():  # one file per error; the first case that met it
            self._record("internal", name, {"error": verdict.error, "traceback": traceback, "case": case.to_dict()})
        print(f"\nfuzzshard internal error (not a finding): {verdict.error}\n{traceback or ''}"
              f"\n  -> {path}", file=self.progress)
        return path

    def _record(self, folder: str, name: str, record: dict) -> Path:
        """OUT/<folder>/<name>.json: what is kept beside the findings, never one of them."""
        return keep_apart(self.out, folder, name, record)

    # -- reduction ---------------------------------------------------------------
    def _reduce(self, sig: str, track: Track, budget: float) -> None:
        """Make the smallest case 1-minimal (reduce.py): each structural edit
        Hypothesis does not make (drop the checkpoint, the scaler, the
        scheduler, the clip; fewer ranks; drop a layer and re-fit the widths,
        a group, a frozen param, ...) is tried and kept while the case still
        gives ``sig``, to a fixed point, within ``budget`` seconds; the file
        is rewritten as it shrinks, and says how far the reducer got
        (``reduction``: 1-minimal, or stopped after N s with K edits untried)."""
        case, verdict = track.best
        if oracles.hangs(verdict) or verdict.timeout or verdict.unconfirmed:
            track.state = UNREDUCED  # each edit could cost a timeout
            self._reduction[sig] = {"minimal": False, "why": "a hang or a case not confirmed: not reduced (each edit "
                                                             "could cost a timeout)"}
            return
        verdicts: dict[str, Verdict] = {}

        def keeps_bugs(cases: list) -> list[bool]:
            judged = self._judge_variants(cases)
            self.stats.reduced_runs += len(cases)
            for c, j in zip(cases, judged):
                verdicts[c.to_json()] = j.verdict
            self.tick()
            return [j.label == sig for j in judged]

        def smaller(c) -> None:
            track.best = (c, verdicts[c.to_json()])
            self._rewrite(sig, track)

        track.state = REDUCING
        self.tick(force=True)
        r: Reduction = minimize(case, budget_s=max(0.0, budget), on_smaller=smaller, keeps_bugs=keeps_bugs,
                                batch=self.pack, stop=lambda: self.stopped)
        self.stats.reduce_seconds += r.seconds
        self._removed[sig] = self._removed.get(sig, []) + r.kept
        self._reduction[sig] = r.record()
        track.state = MINIMAL if r.minimal else CUT
        self.tick(force=True)
        if not r.minimal:
            self._say(f"finding {sig}: not 1-minimal: reduction stopped after {r.seconds:.0f}s "
                      f"({r.runs} edited run(s)), {r.untried} edit(s) untried")

    def _time_left(self) -> bool:
        if self.stopped:
            return False
        return self.until is None or time.monotonic() < self.until

    # -- its files ---------------------------------------------------------------
    def _rewrite(self, sig: str, track: Track, force: bool = False) -> None:
        if track.best is track.written or track.best[1].timeout:
            return
        if force or time.monotonic() - track.last_write >= WRITE_EVERY:
            self._write(sig, track.best, first=False)
            track.written, track.last_write = track.best, time.monotonic()

    def _write(self, sig: str, found: tuple, first: bool) -> bool:
        """Write the finding's files (whole or not at all); False: not this session's to write."""
        f = self._finding(sig, found)
        if not self._put(f, first):
            return False
        self.findings[sig] = f
        return True

    def _put(self, f: Finding, first: bool) -> bool:
        """Put ``f``'s files in place (``first``: its first sight); False: someone else's (see SoakBook)."""
        put_finding(self.findings_dir, f)
        return True

    _script = staticmethod(script_of)  # the finding's standalone .py (files.py: repro.py's)

    def _finding(self, sig: str, found: tuple) -> Finding:
        case, verdict = found
        track = self.tracks.get(sig)
        unconfirmed = verdict.unconfirmed
        confirmed = not unconfirmed and (track is None or found is track.confirmed)
        stage = Stage.CONFIRMED if confirmed else Stage.UNCONFIRMED if unconfirmed else Stage.SHRINKING
        if verdict.timeout:  # a hang seen under a shorter limit than --case-timeout (its "timeout")
            confirmed, stage = False, Stage.PROVISIONAL
        env = environment(self.pool.info, self.pool.options.backend, self.pool.options.device)
        if self.plugins:
            env["plugins"] = self.plugins
        faces = sorted(s for s, o in self._owner.items() if o == sig and s != sig)
        table = [f.to_dict() for f in self._table(sig)]
        kept = replace(verdict, unconfirmed=None,  # the stage says it
                       keys=verdict.keys and tuple(k for k in verdict.keys if k != "unconfirmed"))
        return Finding(sig, case, kept, deterministic=confirmed, environment=env, stage=stage, faces=faces,
                       generalization=table, removed=self._removed.get(sig, []),
                       reduction=self._reduction.get(sig, {}) if track is None or track.settled else {})

    def _say(self, text: str) -> None:
        print(text, file=self.progress, flush=True)

    def _write_provisional(self, sig: str, case, verdict: Verdict) -> bool:
        """A hang seen under a derived limit, on disk at once (stage ``provisional``), before the run at
        the full timeout that confirms it: a stop or a kill meanwhile keeps it. False: not this session's."""
        if not self._write(sig, (case, verdict), first=True):
            return False
        self._say(f"new finding {sig}: provisional (hung past {verdict.timeout:.0f}s, a limit derived from the "
                  f"passing cases) -> {self.findings_dir / sig}.json; confirming at the full timeout in fresh workers")
        return True

    def _unwrite(self, sig: str) -> None:
        """Files written at first sight that are no finding of this session after all (a provisional hang
        that finished at the full timeout; a face of a known finding or of another finding): they go."""
        self.findings.pop(sig, None)
        drop_finding(self.findings_dir, sig)


class SoakBook(FindingBook):
    """A soak cell's findings, in the folder every cell shares: the first sight
    of a signature is published once for every cell (os.link: the first cell
    wins, the others count it as known: no second shrink); later shrinks
    rewrite the cell's own file. ``origin`` says which cell wrote it."""

    def __init__(self, *args, origin: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.origin = origin

    def _put(self, f: Finding, first: bool) -> bool:
        f.environment["origin"] = {**self.origin, "pid": os.getpid(), "time": time.time()}
        if not first:
            return super()._put(f, first)
        if publish_finding(self.findings_dir, f, self._script(f)):
            return True
        self.catch_up()  # another cell's now: a known finding here
        return False

    def catch_up(self) -> None:
        """Findings other cells published count as known here: no second shrink."""
        for p in self.findings_dir.glob("*.json"):
            sig = p.stem
            if sig not in self.known:
                try:
                    self.known[sig] = load_finding(p)
                except Exception:
                    pass


def smaller_case(a, b) -> bool:
    """Whether case ``a`` is a smaller repro than ``b``: fewer ranks, then a shorter case."""
    return (a.ranks, len(a.to_json())) < (b.ranks, len(b.to_json()))


# -- a simulated finding's last step: real processes ----------------------------------------------------
def confirm_on_real(findings: list, out: str | Path, pools, progress=None, set_aside: dict | None = None,
                    optimizer_names: list | None = None) -> dict:
    """The last step of a simulated session's findings (``fuzz --simulate``): each one shrunk, simulated, to
    the least world its signature allows (onset.least_worlds: the one shrinker's world pass), then run on real
    gloo process groups (fresh workers, its own world size) where it fits this machine (real.REAL_MAX): the
    same signature confirms it (its file's ``simulation`` says so); anything else makes it a LocalTensor
    limitation (or a harness one), its files moved to OUT/simulation_limits/ with what the real run said (a
    real run that fails otherwise, with no known bug, is written as a finding of its own); more ranks than
    REAL_MAX: "simulated only". Then findings that are one bug met in several modules fold into one file
    (onset.fold_one_bug). Returns {"confirmed", "limits", "simulated_only": [signatures]}, and "folded"
    (signature -> the finding it is a face of), "found" (Findings written), "met" (signature -> a finding
    already written that its real run gave) where any.

    ``set_aside`` (localtensor.SimulatedBook's: signature -> (case, verdict, why, hits)): LocalTensor's own
    errors, unshrunk, judged on real processes too (real.confirm_set_aside; the result then holds
    "set_aside"). ``pools``: the caller's (session/simulate.py's CheckPools): ``pools.simulated()`` and
    ``pools.real(n)`` give started pools for a ``with``; nothing here starts one. ``optimizer_names``: what
    generalizing may swap in (the session's --optimizers)."""
    from .files import amend_finding, set_apart
    from .onset import fold_one_bug, least_worlds
    from .real import LIMITS, REAL_MAX, confirm_set_aside, judge_for_real, write_real
    from .record import read_record

    progress = progress or sys.stderr
    known = load_known()
    out = Path(out)
    result: dict = {"confirmed": [], "limits": [], "simulated_only": []}
    onsets = least_worlds(findings, out, pools, known, progress, optimizer_names)
    for f in findings:
        w = f.case.ranks
        if not (out / f"{f.signature}.json").exists():  # a caller's own Finding: written first, then amended
            put_finding(out, f)
        if w > REAL_MAX:
            f.stage = Stage.SIMULATED_ONLY  # what the session's FINDING line and index say of it
            amend_finding(out, f.signature, stage=Stage.SIMULATED_ONLY.value, simulation={
                "status": Stage.SIMULATED_ONLY.value, "world_size": w,
                "why": f"{w} ranks: more than the {REAL_MAX} this machine runs for real"})
            result["simulated_only"].append(f.signature)
            print(f"fuzzshard: {f.signature}: SIMULATED ONLY (world size {w} > {REAL_MAX})", file=progress)
            continue
        print(f"fuzzshard: {f.signature}: confirming on {w} real gloo processes", file=progress, flush=True)
        j, env, real = judge_for_real(f.case, pools, known)
        if j.signature == f.signature:
            amend_finding(out, f.signature, simulation={"status": "confirmed on real process groups", "real": real})
            result["confirmed"].append(f.signature)
            print(f"fuzzshard: {f.signature}: CONFIRMED on {w} real processes", file=progress)
            continue
        data = read_record(out, f.signature)
        data["simulation"] = {"status": "LocalTensor limitation: not reproduced on real process groups", "real": real}
        set_apart(out, LIMITS, f.signature, data)
        result["limits"].append(f.signature)
        print(f"fuzzshard: {f.signature}: not a finding: real processes give {j.label} "
              f"-> {out / LIMITS}/{f.signature}.json (a LocalTensor limitation)", file=progress)
        if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
            result.setdefault("met", {})[f.signature] = j.signature  # a finding already written: its file kept
        elif j.verdict.is_finding and not j.known:  # the real run fails otherwise, with no known bug: a finding
            found = write_real(out, f.case, j, env, f"found on real process groups through the simulated "
                               f"finding {f.signature}, which LocalTensor shows otherwise", real)
            result.setdefault("found", []).append(found)
            print(f"fuzzshard: {f.signature}: real processes give a NEW finding {j.signature} "
                  f"-> {out}/{j.signature}.json", file=progress)
    folded = fold_one_bug([f for f in findings if f.signature not in result["limits"]], onsets, out, progress)
    if folded:
        result["folded"] = folded
        for key in ("confirmed", "simulated_only"):
            result[key] = [s for s in result[key] if s not in folded]
    if set_aside:
        result.update(set_aside=[], found=[])
        confirm_set_aside(set_aside, out, pools, result, progress)
    return result
