"""One finding per bug: the part of a finding's life (life.py's FindingBook) that decides which bug a
confirmed signature is. Its case is re-run along the dimensions a bug may not depend on (generalize.py), the
other targets that can carry it among them: a face a finding already has is folded into it; a face of a
known finding makes it a hit of that one (kept in ``OUT/known_faces/``); an error met on another target with
the same address and message as a finding already made is that finding (unless a variant ran one's case on
the other's target and it did not fail so); a new error whose address comes down to a known root cause is a
hit of it. ``OneBug`` is FindingBook's base: it works on the book's own state (tracks, owners, tables)."""
from __future__ import annotations

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from .generalize import Face, generalize, kin
from .judge import Judgement, judge_many
from .record import Finding, Stage
from .rootcause import address, detail, template
from ..verdict import Verdict

KNOWN_BY_ADDRESS = Stage.KNOWN_BY_ADDRESS  # a new signature the session counts as a known root cause's


class OneBug:
    """FindingBook's one-finding-per-bug steps (life.py keeps the state they read and write)."""

    def _generalize(self, sig: str, case, verdict: Verdict) -> set[str]:
        """Re-run ``case`` along the dimensions a bug may not depend on
        (generalize.py): its table is kept for the file; returns the signatures
        this one bug shows under (``sig`` among them)."""
        if oracles.costly(verdict) or verdict.unconfirmed:
            return {sig}  # named by where it stops, whatever the optimizer; each variant could cost a timeout
        if not self._time_left():
            return {sig}  # stopped, or the session's time is up: its variants are not run
        table, faces = generalize(self._judge_variants, case, verdict, self.optimizer_names, self._carried_to(case))
        self._tables[sig] = table
        self._generalized[sig] = case.to_json()
        self.stats.generalized += len(table)
        return faces | {sig}

    def _carried_to(self, case) -> tuple:
        """The other targets a finding's case is run on (generalize.kin): on a simulated pool, only
        those --simulate runs."""
        if self.pool.options.simulate:
            from ..kernel.simulated import SIMULATED_TARGETS

            return tuple(t for t in kin(case.target) if t in SIMULATED_TARGETS)
        return kin(case.target)

    def _judge_variants(self, cases: list) -> list[Judgement]:
        """Variants and edits of a finding's case, side by side, each limited like a case that shrinks a hang."""
        return judge_many(self.pool, cases, self.known, [self.variant_timeout(c) for c in cases])

    def _known_face(self, sig: str, known: str, found: tuple) -> None:
        """``sig`` is the known finding ``known`` in another face: a variant of
        its case, changed in one dimension, fails the same way under that
        signature. Counted as a known hit; its case is kept in
        OUT/known_faces/<sig>.json for ``fuzzshard known`` to record."""
        case, verdict = found
        self._as_known[sig] = known
        self.stats.known[known] += 1
        rows = [f for f in self._tables.get(sig, []) if f.signature == self.known[known].signature]
        how = f" with {rows[0].dimension} {rows[0].value}" if rows else " (another quantity of the same run)"
        record = {"signature": sig, "known": known, "root_cause": self.known[known].root_cause,
                  "generalization": [f.to_dict() for f in self._tables.get(sig, [])],
                  "verdict": verdict.to_dict(), "case": case.to_dict()}
        path = self._record("known_faces", sig, record)
        self._say(f"new signature {sig}: the known finding {known} in another face (it fails the same way{how}; "
                  f"root cause {self.known[known].root_cause or '?'}) -> {path}")

    def _known_by_address(self, sig: str, hit, case, verdict: Verdict) -> None:
        """``sig`` is known root cause ``hit.root_cause`` by its address (rootcause.Matcher.known_hit):
        counted under it, its case kept in OUT/known_faces/<sig>.json, and known from here on (the
        session's summary names it, with the op it met)."""
        self.known[sig] = Finding(sig, case, verdict, root_cause=hit.root_cause, stage=KNOWN_BY_ADDRESS,
                                  diagnosis=f"{KNOWN_BY_ADDRESS}: {hit.text}")
        self.stats.known[sig] += 1
        record = {"signature": sig, "root_cause": hit.root_cause, "address": hit.address, "detail": hit.detail,
                  "named": hit.named, "verdict": verdict.to_dict(), "case": case.to_dict()}
        path = self._record("known_faces", sig, record)
        self._say(f"new signature {sig}: root cause {hit.root_cause} by its address ({hit.address}"
                  f"{'; ' + hit.text if hit.detail else ''}), a known hit -> {path}")

    def _fold(self, owner: str, faces: set[str]) -> None:
        """``faces`` are ``owner``'s now; its file says so (a face on another target in its target row)."""
        for s in faces:
            self._owner.setdefault(s, owner)
        self._met_on(owner, faces)
        track = self.tracks.get(owner)
        if track is not None:
            self._write(owner, track.written, first=False)

    def _met_on(self, owner: str, faces) -> None:
        """The targets other than ``owner``'s that ``faces`` failed on, in their own cases: its target row."""
        own = self._target_of(owner)
        for s in sorted(faces):
            target = self._target_of(s)
            if target and target != own:
                self._met.setdefault(owner, {}).setdefault(target, s)

    def _target_of(self, sig: str) -> str:
        track = self.tracks.get(sig)
        return track.confirmed[0].target if track else sig.split(".", 1)[0]

    def _same_error_elsewhere(self, sig: str, case, verdict: Verdict) -> str | None:
        """A finding already made on a kin target (generalize.kin) that is this error: the same
        address, message template and missing op, and no variant that ran either case on the other's
        target passed or failed otherwise. Errors only: a divergence's address says where it showed,
        not what made it, and two planted bugs there would read as one."""
        if not oracles.raised(verdict):
            return None
        mine = (address(case, verdict), template(case, verdict), detail(case, verdict))
        for other in sorted(self.tracks):
            o_case, o_verdict = self.tracks[other].confirmed
            if o_case.target not in kin(case.target) or case.target not in kin(o_case.target) \
                    or not oracles.raised(o_verdict):
                continue
            if (address(o_case, o_verdict), template(o_case, o_verdict), detail(o_case, o_verdict)) != mine:
                continue
            if not self._ran_apart(sig, o_case.target) and not self._ran_apart(other, case.target):
                return other
        return None

    def _ran_apart(self, sig: str, target: str) -> bool:
        """Whether ``sig``'s case, carried to ``target``, passed there or failed otherwise."""
        return any(f.dimension == "target" and f.value == target and f.outcome in ("passes", "fails otherwise")
                   for f in self._tables.get(sig, []))

    def _table(self, sig: str) -> list[Face]:
        """``sig``'s generalization table, with the targets its other faces failed on in their own cases."""
        table = list(self._tables.get(sig, []))
        for target, face in sorted(self._met.get(sig, {}).items()):
            rows = [f for f in table if f.dimension == "target" and f.value == target]
            if not any(f.outcome == "fails" for f in rows):  # (a variant that ran otherwise stays beside it)
                table.append(Face("target", target if not rows else f"{target} (in its own case)", "fails", face))
        return table

    def _generalize_again(self, sig: str) -> None:
        """The table of ``sig``'s smallest case, and one finding per bug: a
        finding that case's variants fail as (the same way) is a face of the
        same bug. Its signature goes into this finding's file, then its own
        files go (this one is written first: nothing found is lost)."""
        track = self.tracks[sig]
        if self._generalized.get(sig) == track.written[0].to_json():
            return
        faces = self._generalize(sig, *track.written)
        merged = sorted(s for s in faces if s in self.tracks and s != sig)
        for other in merged:
            moved = {other, *self._met.pop(other, {}).values()}  # its faces, on any target, are this one's now
            for s, o in list(self._owner.items()):
                if o == other:
                    self._owner[s] = sig
                    moved.add(s)
            self._met_on(sig, moved)
            self.tracks.pop(other)
            self.findings.pop(other, None)
            self.stats.folded[sig] += 1
        for s in faces:
            self._owner.setdefault(s, sig)
        self._write(sig, track.written, first=False)
        self.findings[sig] = self._finding(sig, track.written)
        for other in merged:
            self._say(f"finding {other}: another face of finding {sig} (its smallest case fails the same way there), "
                      f"folded into it")
            for suffix in (".json", ".py"):
                (self.findings_dir / f"{other}{suffix}").unlink(missing_ok=True)
