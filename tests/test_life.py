"""A finding's life (life.py) without workers: a scripted pool gives the
verdicts, the book confirms, writes, reports contamination and, as a soak's
cells do, publishes into a shared folder where the first writer wins."""
import io
import json
from types import SimpleNamespace

from cases import simple_case

from fuzzshard.session.engine import Stats
from fuzzshard.findings.life import FindingBook, SoakBook
from fuzzshard.verdict import Verdict, finding, passing

SIG = "dtensor.parity.SGD.forloop.param"


class ScriptedPool:
    """Runs nothing: an SGD case fails (``warm`` / ``fresh``: in warm or fresh workers), any other passes."""

    def __init__(self, fresh_fails=True):
        self.fresh_fails, self.generation, self.history = fresh_fails, 0, []
        self.info, self.options = {"torch": "x"}, {"backend": "gloo", "device": "cpu"}

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


def _book(tmp_path, pool, cls=FindingBook, **kw):
    progress = io.StringIO()
    return cls(pool, tmp_path, Stats(), known={}, progress=progress, optimizer_names=["SGD", "Adam"], **kw), progress


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
    verdict = book.pool.run_many([case], [None])[0].verdict
    assert not book.accept(SIG, case, verdict) and not book.accept(SIG, case, verdict)
    assert book.stats.contaminated == 2 and not list(tmp_path.glob("*.json"))
    assert f"fuzzshard internal error (contaminated, not a finding): {SIG} in the warm workers, pass" in said.getvalue()
    assert json.loads((tmp_path / "contaminated" / f"{SIG}.json").read_text())["fresh_signature"] == "pass"


def test_soak_cells_publish_once_and_the_later_one_counts_it_known(tmp_path):
    case = simple_case(2, optim="SGD", foreach=False)
    first, _ = _book(tmp_path, ScriptedPool(), SoakBook, origin={"cell": "e0c0"})
    second, _ = _book(tmp_path, ScriptedPool(), SoakBook, origin={"cell": "e0c1"})
    assert first.accept(SIG, case, first.pool.run_many([case], [None])[0].verdict)
    assert not second.accept(SIG, case, second.pool.run_many([case], [None])[0].verdict)
    assert SIG in second.known and not second.tracks
    assert json.loads((tmp_path / f"{SIG}.json").read_text())["environment"]["origin"]["cell"] == "e0c0"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{SIG}.json", f"{SIG}.py"]
