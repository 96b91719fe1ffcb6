"""A finding's life (life.py) without workers: a scripted pool gives the
verdicts, the book confirms, writes, reports contamination and, as a soak's
cells do, publishes into a shared folder where the first writer wins."""
import dataclasses
import io
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

from cases import simple_case

from fuzzshard.session.engine import Stats
from fuzzshard.findings.generalize import Face, table_text
from fuzzshard.findings.life import FindingBook, SoakBook
from fuzzshard.pool.options import PoolOptions
from fuzzshard.findings.record import load_finding, load_known
from fuzzshard.verdict import Verdict, finding, passing

SIG = "dtensor.parity.SGD.forloop.param"


class ScriptedPool:
    """Runs nothing: an SGD case fails (``warm`` / ``fresh``: in warm or fresh workers), any other passes."""

    def __init__(self, fresh_fails=True):
        self.fresh_fails, self.generation, self.history = fresh_fails, 0, []
        self.info, self.options = {"torch": "x"}, PoolOptions(backend="gloo")

    def fresh(self):
        self.generation += 1
        self.history = []

    def run_many(self, cases, timeouts):
        out = []
        for c in cases:
            bad = c.optim.name == "SGD" and (self.fresh_fails or not self.generation)
            v = Verdict.from_dict(finding("parity", [{"quantity": "param", "fqn": "layers.2.weight", "step": 0,
                                                      "detail": "d"}]) if bad else passing())
            self.history.append((c, v))
            out.append(SimpleNamespace(verdict=v, seconds=0.0, timings={}))
        return out


def _book(tmp_path, pool, cls=FindingBook, known=None, **kw):
    progress = io.StringIO()
    return cls(pool, tmp_path, Stats(), known=known or {}, progress=progress, optimizer_names=["SGD", "Adam"],
               **kw), progress


def test_a_new_signature_is_confirmed_fresh_written_and_finished(tmp_path):
    book, said = _book(tmp_path, ScriptedPool())
    case = simple_case(2, optim="SGD", foreach=False)
    assert book.accept(SIG, case, book.pool.run_many([case], [None])[0].verdict)
    assert f"new finding {SIG}, confirmed in fresh workers -> {tmp_path / SIG}.json" in said.getvalue()
    data = json.loads((tmp_path / f"{SIG}.json").read_text())
    assert data["stage"] == "confirmed" and (tmp_path / f"{SIG}.py").exists()
    assert {f["value"]: f["outcome"] for f in data["generalization"]}["Adam"] == "passes"
    smaller = simple_case(1, optim="SGD", foreach=False)
    assert book.accept(SIG, smaller, book.pool.run_many([smaller], [None])[0].verdict)
    assert book.shrinking() == 1
    book.finish()
    assert book.shrinking() == 0 and book.findings[SIG].case.world_size == 1
    assert json.loads((tmp_path / f"{SIG}.json").read_text())["stage"] == "confirmed"


def test_a_verdict_fresh_workers_do_not_give_is_contaminated_never_a_finding(tmp_path):
    book, said = _book(tmp_path, ScriptedPool(fresh_fails=False))
    case = simple_case(2, optim="SGD", foreach=False)
    verdict = book.pool.run_many([simple_case(2, optim="Adam", foreach=False), case], [None, None])[1].verdict
    assert not book.accept(SIG, case, verdict) and not book.accept(SIG, case, verdict)
    assert book.stats.contaminated == 2 and not list(tmp_path.glob("*.json"))
    assert f"fuzzshard internal error (contaminated, not a finding): {SIG} in the warm workers, pass" in said.getvalue()
    assert json.loads((tmp_path / "contaminated" / f"{SIG}.json").read_text())["fresh_signature"] == "pass"


def test_a_verdict_fresh_workers_do_not_give_with_nothing_run_before_it_is_unsteady(tmp_path):
    """Workers that ran nothing before the case carried nothing into it: a verdict that fresh ones do not give
    again is the case's own unsteadiness (torch 2.9.1's pipelining abort: a crash, or the dying rank's error
    first), counted apart in OUT/unsteady/, neither a finding nor fuzzshard's fault."""
    book, said = _book(tmp_path, ScriptedPool(fresh_fails=False))
    case = simple_case(2, optim="SGD", foreach=False)
    verdict = book.pool.run_many([case], [None])[0].verdict
    assert not book.accept(SIG, case, verdict) and not book.accept(SIG, case, verdict)
    assert book.stats.unsteady == 2 and book.stats.contaminated == 0 and not list(tmp_path.glob("*.json"))
    assert f"unsteady, not a finding: {SIG} in workers that had run nothing before it, pass" in said.getvalue()
    assert json.loads((tmp_path / "unsteady" / f"{SIG}.json").read_text())["fresh_signature"] == "pass"
    assert not (tmp_path / "contaminated").exists()


def test_soak_cells_publish_once_and_the_later_one_counts_it_known(tmp_path):
    case = simple_case(2, optim="SGD", foreach=False)
    first, _ = _book(tmp_path, ScriptedPool(), SoakBook, origin={"cell": "e0c0"})
    second, _ = _book(tmp_path, ScriptedPool(), SoakBook, origin={"cell": "e0c1"})
    assert first.accept(SIG, case, first.pool.run_many([case], [None])[0].verdict)
    assert not second.accept(SIG, case, second.pool.run_many([case], [None])[0].verdict)
    assert SIG in second.known and not second.tracks
    assert json.loads((tmp_path / f"{SIG}.json").read_text())["environment"]["origin"]["cell"] == "e0c0"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{SIG}.json", f"{SIG}.py"]


# -- one finding per bug across targets, and known in any face (GPU evidence: tests/data/evidence) ----------
EVIDENCE = Path(__file__).parent / "data" / "evidence"
DSD = {t: load_finding(EVIDENCE / f"{t}.error.load.ValueError.646b60be.json") for t in ("dtensor", "fsdp2")}


def _known_before_646b60be() -> dict:
    """The known list as the session that met 646b60be had it: without that root cause (recorded since)."""
    return {s: f for s, f in load_known().items() if "646b60be" not in s}


class DSDPool(ScriptedPool):
    """DSD's full-state-dict load refusing a 1-element CPU lr beside CUDA state, on any target: a case
    with such an lr and a full (or broadcast) load fails as recorded (tp as dtensor); ``only``: those
    two recorded cases alone fail, any other is ``others`` (a verdict status)."""

    def __init__(self, only=False, others="pass"):
        super().__init__()
        self.only, self.others = only, others

    def run_many(self, cases, timeouts):
        out = []
        for c in cases:
            f = DSD["fsdp2" if c.target == "fsdp2" else "dtensor"]
            if self.only:
                bad = any(c.to_json() == g.case.to_json() for g in DSD.values())
            else:
                bad = c.optim.tensor_lr == "1d" and c.checkpoint and c.checkpoint.kind in ("full", "broadcast")
            v = f.verdict if bad else Verdict.from_dict(passing() if self.others == "pass" else
                                                        {"status": "invalid", "reason": "refused"})
            self.history.append((c, v))
            out.append(SimpleNamespace(verdict=v, seconds=0.0, timings={}))
        return out


def _met(book, target):
    f = DSD[target]
    return book.accept(f.signature, f.case, f.verdict)


def test_one_bug_met_on_dtensor_and_fsdp2_is_one_finding_with_a_target_row(tmp_path):
    """646b60be, DSD's "Device mismatch", came out as a dtensor and an fsdp2
    finding: the fsdp2 case carried to dtensor (its params Shard(0) there too)
    fails the same way, so the second is a face of the first."""
    book, said = _book(tmp_path, DSDPool(), known=_known_before_646b60be())
    assert _met(book, "dtensor") and not _met(book, "fsdp2")
    sig, other = DSD["dtensor"].signature, DSD["fsdp2"].signature
    assert f"new signature {other}: another face of finding {sig}" in said.getvalue()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"{sig}.json"]
    data = json.loads((tmp_path / f"{sig}.json").read_text())
    assert other in data["faces"] and "tp.error.load.ValueError.646b60be" in data["faces"]  # tp: its own variant
    rows = [Face(**r) for r in data["generalization"] if r["dimension"] == "target"]
    assert "target: fails with tp, fsdp2" in table_text(rows)  # its variant on tp, then fsdp2 in its own case
    assert book.new_signature(SimpleNamespace(known=False, signature=other)) is None and book.stats.folded[sig] == 1


def test_two_findings_on_two_targets_with_one_address_fold_unless_a_variant_ran_them_apart(tmp_path):
    """Met separately (the fsdp2 case's dtensor variant could not run: the reference refused it), the
    same error at the same address on dtensor and fsdp2 is one finding; where that variant passes on
    dtensor, the two stay two: nothing says they are one bug."""
    book, said = _book(tmp_path / "a", DSDPool(only=True, others="invalid"), known=_known_before_646b60be())
    assert _met(book, "dtensor") and not _met(book, "fsdp2")
    sig, other = DSD["dtensor"].signature, DSD["fsdp2"].signature
    assert f"new signature {other}: finding {sig} on another target (the same address and message: raises " \
           f"ValueError in torch/distributed/checkpoint/state_dict.py:_device), folded into it" in said.getvalue()
    data = json.loads((tmp_path / "a" / f"{sig}.json").read_text())
    assert other in data["faces"] and {"dimension": "target", "value": "fsdp2", "outcome": "fails",
                                       "signature": other} in data["generalization"]
    apart, _ = _book(tmp_path / "b", DSDPool(only=True), known=_known_before_646b60be())
    assert _met(apart, "dtensor") and _met(apart, "fsdp2")
    assert sorted(p.name for p in (tmp_path / "b").glob("*.json")) == [f"{sig}.json", f"{other}.json"]


def test_a_new_signature_with_a_known_root_causes_address_is_a_known_hit_and_the_summary_names_its_op(
        tmp_path, capsys):
    """2.11's missing strategy for foreach lerp_ (an op the root cause does not name) and Adafactor's
    known bug met in a load: counted under their root causes, no finding files; the summary lists the
    signature and the op; the tp face of the first is known from then on."""
    from fuzzshard.cli.fuzz import _print_session_report
    from fuzzshard.findings.record import known_signature

    book, said = _book(tmp_path, ScriptedPool(), known=load_known())
    lerp = load_finding(EVIDENCE / "dtensor.error.step.NotImplementedError.af1d5b0d._foreach_lerp_.json")
    load = load_finding(EVIDENCE / "dtensor.error.load.RuntimeError.89967c22.json")
    for f in (lerp, load):
        assert not book.accept(f.signature, f.case, f.verdict) and book.stats.known[f.signature] == 1
        assert not (tmp_path / f"{f.signature}.json").exists() and not book.tracks
    assert book.known[load.signature].root_cause == "adafactor-inplace-square-on-norm-partial"
    record = json.loads((tmp_path / "known_faces" / f"{lerp.signature}.json").read_text())
    assert (record["root_cause"], record["detail"], record["named"]) == \
        ("dtensor-missing-strategy-optimizer-ops", "aten._foreach_lerp_", False)
    tp = dataclasses.replace(lerp.case, target="tp")
    assert known_signature(lerp.signature.replace("dtensor.", "tp.", 1), tp, book.known) == lerp.signature
    session = SimpleNamespace(stats=book.stats, elapsed=1.0, duration=None, stop_reason=None, book=book,
                              pool=SimpleNamespace(restarts=0), matcher=book.matcher, contaminated=[], unsteady=[], known=book.known)
    _print_session_report(session, [], tmp_path)
    text = capsys.readouterr().err
    assert "known   dtensor-missing-strategy-optimizer-ops ×1 [not reported]" in text
    assert f"        {lerp.signature} ×1, known by address: aten._foreach_lerp_, an op the root cause does not name" in text
    assert "known   adafactor-inplace-square-on-norm-partial ×1" in text and "no new findings" in text


class ReducedCaseNotConfirmed(ScriptedPool):
    """SGD fails on 2 ranks everywhere; on 1 rank only until the second fresh generation (the one that
    confirms the reducer's smallest case at the session's end)."""

    def run_many(self, cases, timeouts):
        out = super().run_many(cases, timeouts)
        for c, r in zip(cases, out):
            if c.world_size != 2 and self.generation >= 2:
                r.verdict = Verdict.from_dict(passing())
        return out


def test_a_file_put_back_to_its_confirmed_case_lists_no_edit_that_case_lacks(tmp_path):
    book, _ = _book(tmp_path, ReducedCaseNotConfirmed())
    case = simple_case(2, optim="SGD", foreach=False)
    assert book.accept(SIG, case, book.pool.run_many([case], [None])[0].verdict)
    book.finish()  # the reducer reaches 1 rank; fresh workers do not confirm it: the file keeps the 2-rank case
    data = json.loads((tmp_path / f"{SIG}.json").read_text())
    assert data["case"]["world_size"] == 2 and book.findings[SIG].case.world_size == 2
    assert data.get("removed", []) == [] and book.findings[SIG].removed == [], book.findings[SIG].removed


# -- one bug across oracles: a replica that drifted before a save, met as the save's face too --------------
class DriftPool(ScriptedPool):
    """Every param replicated and stepped twice on rank 1 by SGD (the planted replica bug of test_generalize.py):
    the replica oracle's drift at step 0; a case saved after step 0 (DCP took rank 1's copy of three params)
    names the checkpoint's oracle instead (kernel/run.py's _replica_first, at the save's step)."""

    def run_many(self, cases, timeouts):
        out = []
        for c in cases:
            names = ("layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias")
            ck = c.checkpoint is not None and c.checkpoint.after == 0
            v = Verdict.from_dict(passing() if c.optim.name != "SGD" else finding(
                "checkpoint" if ck else "replica",
                [{"quantity": "loaded.param" if ck else "param", "fqn": n, "step": 0, "detail": "d"}
                 for n in (names[1:] if ck else names)]))
            self.history.append((c, v))
            out.append(SimpleNamespace(verdict=v, seconds=0.0, timings={}))
        return out


def test_a_replica_drift_and_the_checkpoint_face_it_leaves_are_one_finding_whichever_is_met_first(tmp_path):
    from fuzzshard.case import Checkpoint

    drift_case = dataclasses.replace(simple_case(2, optim="SGD", foreach=False), target_options={})
    saved_case = dataclasses.replace(drift_case, checkpoint=Checkpoint(0, "dcp", 2, (2,)))
    drift, saved = "dtensor.replica.param", "dtensor.checkpoint.dcp.loaded.param"
    for order in ((drift, drift_case), (saved, saved_case)), ((saved, saved_case), (drift, drift_case)):
        out = tmp_path / order[0][0]
        book, said = _book(out, DriftPool())
        (first, first_case), (second, second_case) = order
        assert book.accept(first, first_case, book.pool.run_many([first_case], [None])[0].verdict)
        if second == saved:  # met second, its case up to the save fails earlier as the finding made
            assert not book.accept(second, second_case, book.pool.run_many([second_case], [None])[0].verdict)
            assert f"new signature {saved}: another face of finding {drift}" in said.getvalue()
        else:  # the first one's variant named it already: a face, counted there, never a file of its own
            assert book.new_signature(SimpleNamespace(known=False, signature=drift)) is None
            assert book.stats.folded[saved] == 1
        book.finish()
        assert sorted(p.name for p in out.glob("*.json")) == [f"{first}.json"], said.getvalue()
        data = json.loads((out / f"{first}.json").read_text())
        assert second in data["faces"] and list(book.findings) == [first]
    rows = [Face(**r) for r in data["generalization"] if r["dimension"] == "checkpoint"]
    assert table_text(rows) == f"checkpoint: fails earlier, where it began, with none (its steps up to the save) ({drift})"


# -- 1-minimal whenever found: reduced right after its round, within its budget, past --duration if need be -----
def _reduced_book(tmp_path, budget: float):
    book, said = _book(tmp_path, ScriptedPool())
    case = simple_case(3, optim="SGD", foreach=False)
    assert book.accept(SIG, case, book.pool.run_many([case], [None])[0].verdict)
    book.reduce_round([SIG], time.monotonic() + budget)
    book.settle([SIG])
    return book, said, case


def test_a_rounds_finding_is_reduced_settled_and_not_shrunk_again(tmp_path, capsys):
    """Right after its round: 1-minimal, confirmed, its file saying so; a later case no smaller is met again,
    not shrunk all over again (accept says no); the summary prints its 1-minimal line."""
    from fuzzshard.cli.fuzz import _print_finding

    book, said, case = _reduced_book(tmp_path, 60.0)
    data = json.loads((tmp_path / f"{SIG}.json").read_text())
    assert data["stage"] == "confirmed" and data["case"]["world_size"] == 1, data["case"]
    assert data["reduction"]["minimal"] is True and data["reduction"]["runs"] >= len(data["removed"]) > 0
    assert book.states() == {"1-minimal": 1} and book.shrinking() == 0
    assert not book.accept(SIG, case, book.pool.run_many([case], [None])[0].verdict)
    assert book.met_again == {SIG: 1}
    _print_finding(book.findings[SIG], tmp_path, "", 0, book.met_again[SIG])
    text = capsys.readouterr().err
    assert f"1-minimal ({data['reduction']['runs']} edited run(s) in " in text and "world size 3 -> 1" in text
    assert "1 later case(s) met it again, none smaller" in text


def test_a_reduction_out_of_budget_says_so_in_the_file_and_the_summary(tmp_path, capsys):
    from fuzzshard.cli.fuzz import _print_finding

    book, said, _ = _reduced_book(tmp_path, 0.0)
    data = json.loads((tmp_path / f"{SIG}.json").read_text())
    r = data["reduction"]
    assert r["minimal"] is False and r["untried"] > 0 and r["runs"] == 0 and data["case"]["world_size"] == 3
    assert book.states() == {"not 1-minimal": 1}
    assert re.search(rf"finding {re.escape(SIG)}: not 1-minimal: reduction stopped after \d+s \(0 edited run\(s\)\), "
                     rf"{r['untried']} edit\(s\) untried", said.getvalue()), said.getvalue()
    _print_finding(book.findings[SIG], tmp_path, "", 0)
    assert re.search(rf"not 1-minimal: reduction stopped after \d+s, {r['untried']} edit\(s\) untried",
                     capsys.readouterr().err)


class SlowPool(ScriptedPool):
    """A pool whose every case takes a while, as on a busy machine (Hypothesis's shrink, a run per candidate,
    would take the whole round), with a session's pool attributes; ``on_failure`` is called at each failing
    case it runs."""
    size, case_timeout, restarts, stuck_seconds, restart_seconds = 3, 60.0, 0, 0.0, 0.0
    on_failure = staticmethod(lambda: None)

    def run_many(self, cases, timeouts):
        time.sleep(0.02 * len(cases))
        out = super().run_many(cases, timeouts)
        if any(r.verdict.is_finding for r in out):
            self.on_failure()
        return out


def test_a_finding_met_as_the_duration_ends_is_made_1_minimal_past_it(tmp_path):
    """A bug every SGD case shows, met as the session's duration ends (its last second: the pool ends it at
    the first failing case), with Hypothesis's shrink bounded at 0.1 s: the duration does not cut the
    reduction, which runs right after the round, past the duration (the progress line says so), and the
    file's reduction record says 1-minimal."""
    from fuzzshard.session.engine import Session
    from fuzzshard.session.options import Draws, SessionOptions

    progress, pool = io.StringIO(), SlowPool()
    session = Session(pool, Draws(("dtensor",), (1, 2, 3), optimizer_names=("SGD",)),
                      SessionOptions(out=str(tmp_path), duration=600.0, seed=0, shrink_budget=120.0,
                                     hypothesis_shrink=0.1, pack=1), known={}, progress=progress)
    pool.on_failure = lambda: setattr(session, "_deadline", min(session._deadline, time.monotonic()))
    (finding,) = session.run()
    data = json.loads((tmp_path / f"{finding.signature}.json").read_text())
    assert data["stage"] == "confirmed" and data["reduction"]["minimal"] is True, data.get("reduction")
    assert data["case"]["world_size"] == 1 and len(data["case"]["schedule"]) == 1, data["case"]
    assert data["removed"] and finding.reduction == data["reduction"]
    text = progress.getvalue()
    assert "reducing past it" in text and "(1 1-minimal)" in text, text[-2000:]
