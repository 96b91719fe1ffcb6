"""The search's spread and its hangs (issue 28), without workers: the
coverage-guided schedule (schedule.py) and what the strategies draw from it;
a hang seen under a derived limit written at once as provisional, then
confirmed, dropped or kept (life.py, on a scripted pool); the hunt set."""
import dataclasses
import io
import json
from types import SimpleNamespace

from cases import simple_case
from conftest import PLANTED
from hypothesis import HealthCheck, given, settings

from fuzzshard.case import Layer
from fuzzshard.session.engine import Session, Stats
from fuzzshard.session.options import Draws, SessionOptions
from fuzzshard.findings.record import signature
from fuzzshard.findings.life import FindingBook
from fuzzshard.pool.options import PoolOptions
from fuzzshard.session.schedule import ENERGY, KNOWN_DRAWS, Scheduler, features, weights
from fuzzshard.verdict import ErrorRecord, Verdict, finding, passing


def test_weights_give_the_least_covered_cells_the_most_draws_and_keep_every_cell():
    w = weights({"a": 0, "b": 1, "c": 5, "d": 20})
    assert w[0] == "a" and set(w) == {"a", "b", "c", "d"}
    assert w.count("a") == ENERGY and w.count("b") == ENERGY // 2 and w.count("d") == 1
    assert weights({"x": 3, "y": 3}) == ["x", "y"]  # even: once each


def test_a_timed_session_steers_each_round_to_what_it_covered_least(tmp_path):
    session = Session(None, Draws(), SessionOptions(out=str(tmp_path), duration=60.0, seed=7))
    assert Session(None, Draws(), SessionOptions(out=str(tmp_path), max_examples=10))._steer("dtensor") == {}  # a count-bound one: free
    session._deadline = 1.0  # as run() sets it
    first = session._steer("dtensor")["steer"]
    for turns in first["optimizer by world"].values():  # nothing covered: every cell once, at each world size
        assert len(set(turns)) == len(turns)
    worlds = {w for w, _ in first["plan"]}
    assert worlds == {1, 2, 3, 4}
    # every checkpoint kind x load world size is a cell, and half a world's draws have no checkpoint
    assert {ck for w, ck in first["plan"] if w == 3} >= {None, ("dcp", 2), ("full", 4), ("broadcast", 1)}
    assert sum(ck is None for w, ck in first["plan"] if w == 3) == sum(ck is not None for w, ck in first["plan"] if w == 3)
    assert set(first["mesh"][4]) == {(4,), (2, 2)}
    # a session that drew fused AdamW 40 times, at world size 1 without a checkpoint, on a 1-D mesh
    case = simple_case(1, optim="AdamW", fused=True)
    for _ in range(40):
        session.schedule.record(case, valid=True)
    steer = session._steer("dtensor")["steer"]
    at1 = steer["optimizer by world"][1]
    assert at1.count(("AdamW", "fused")) == 1 and at1[0] != ("AdamW", "fused") and at1.count(at1[0]) == ENERGY
    # pairs: fused AdamW was drawn only at world size 1, so at 3 it is as fresh as any other optimizer
    at3 = steer["optimizer by world"][3]
    assert len(set(at3)) == len(at3) and ("AdamW", "fused") in at3
    share = {w: sum(1 for x, _ in steer["plan"] if x == w) for w in (1, 2, 3, 4)}
    assert share[1] < share[2] == share[3] == share[4]
    assert steer["dtype"].count("float64") > steer["dtype"].count("float32")
    table = session.schedule.table()
    assert "optimizer (1 cells, 40-40): AdamW·fused 40" in table and "world x checkpoint" in table
    # a case that hit a known bug counts as several draws of its cells (the table counts it once)
    session.schedule.record(simple_case(2, optim="SGD"), valid=True, known=True)
    assert session.schedule.drawn["dtensor"]["optimizer", "SGD·forloop"] == KNOWN_DRAWS
    assert session.schedule.valid["dtensor"]["optimizer", "SGD·forloop"] == 1


def test_a_known_bug_before_the_first_step_does_not_count_against_the_optimizer():
    sched = Scheduler()
    case = simple_case(3, optim="Rprop")

    def known_at(stage, phase):
        return Verdict.from_dict(finding("crash", error=ErrorRecord("RuntimeError", "x", phase=phase,
                                                                    extra={"stage": stage}).to_dict()))

    sched.record(case, valid=True, known=True, verdict=known_at("fwdbwd", "step 0: forward/backward"))
    drawn = sched.drawn["dtensor"]
    assert drawn["world x optimizer", "W3 Rprop·forloop"] == drawn["optimizer", "Rprop·forloop"] == 1
    assert drawn["mesh", "3"] == drawn["model", "features in"] == KNOWN_DRAWS  # what ran before it: the model
    for stage, phase in (("step", "step 0: optimizer.step"), ("fwdbwd", "step 1: forward/backward")):
        sched.record(case, valid=True, known=True, verdict=known_at(stage, phase))  # the optimizer had stepped
    assert drawn["world x optimizer", "W3 Rprop·forloop"] == 1 + 2 * KNOWN_DRAWS


def test_the_model_is_counted_in_the_table_but_not_steered():
    """Steering the model's input and layer kinds cost the HSDP 2x2 corner of the hunt (3/3 found within 24 s
    -> 1/3, docs/search.md): its cells are counted and shown, the draws stay Hypothesis's own."""
    sched = Scheduler()
    conv = simple_case(1)
    conv = dataclasses.replace(conv, model=dataclasses.replace(
        conv.model, layers=conv.model.layers + (Layer("conv1d", conv.model.layers[-1].d_out, 2, kernel=1),)))
    assert ("model", "layer conv1d") in features(conv) and ("model", "features in") in features(conv)
    sched.record(conv, valid=True, known=True)
    assert "model" not in sched.steer("dtensor", [1], {})["steer"]
    assert "model (4 cells, 1-1): features in 1, layer act 1, layer conv1d 1, layer linear 1" in sched.table()


class HangPool:
    """Runs nothing: every case hangs on rank 1, or (``finishes``) passes in fresh workers (it was only slow)."""

    case_timeout = 120.0

    def __init__(self, finishes=False, check=None):
        self.finishes, self.check, self.generation, self.history, self.timeouts = finishes, check, 0, [], []
        self.info, self.options = {"torch": "x"}, PoolOptions(backend="gloo")

    def fresh(self):
        self.generation += 1
        self.history = []

    def run_many(self, cases, timeouts):
        self.timeouts += list(timeouts)
        if self.check:
            self.check()
        out = []
        for c, t in zip(cases, timeouts):
            v = Verdict.from_dict(passing()) if self.finishes and self.generation else hang(t)
            self.history.append((c, v))
            out.append(SimpleNamespace(verdict=v, seconds=0.0, timings={}))
        return out


def hang(timeout=None):
    v = finding("hang", error=ErrorRecord("Hang", "ranks [1] still running").to_dict(), stuck_ranks=[1],
                where={1: "run._steps:step"})
    return Verdict.from_dict({**v, "timeout": timeout} if timeout else v)


def _book(tmp_path, pool):
    return FindingBook(pool, tmp_path, Stats(), known={}, progress=io.StringIO(), optimizer_names=["SGD"])


def test_a_hang_under_a_derived_limit_is_on_disk_before_its_confirmation(tmp_path):
    case = simple_case(2, optim="Adagrad")
    sig = signature(case, hang(12.0))
    stages = []
    pool = HangPool(check=lambda: stages.append(json.loads((tmp_path / f"{sig}.json").read_text())["stage"]))
    book = _book(tmp_path, pool)
    assert book.accept(sig, case, hang(12.0))
    assert stages == ["provisional"]  # written before the run at the full timeout, which saw it
    assert pool.timeouts == [None]  # the confirmation: at the full --case-timeout
    assert json.loads((tmp_path / f"{sig}.json").read_text())["stage"] == "confirmed"
    assert "provisional (hung past 12s" in book.progress.getvalue()


def test_a_provisional_hang_that_finishes_at_the_full_timeout_is_dropped(tmp_path):
    case = simple_case(2, optim="Adagrad")
    sig = signature(case, hang(12.0))
    book = _book(tmp_path, HangPool(finishes=True))
    assert not book.accept(sig, case, hang(12.0))
    assert book.stats.slow == 1 and not list(tmp_path.glob("*.json")) and sig not in book.findings


def test_a_stop_keeps_a_provisional_hang_and_the_session_end_bounds_its_confirmation(tmp_path):
    import time

    case = simple_case(2, optim="Adagrad")
    sig = signature(case, hang(12.0))
    book = _book(tmp_path, HangPool())
    book.stopped = True
    assert not book.accept(sig, case, hang(12.0))
    data = json.loads((tmp_path / f"{sig}.json").read_text())
    assert data["stage"] == "provisional" and data["verdict"]["timeout"] == 12.0 and not data["deterministic"]
    # 30 s left of the session: the confirmation runs that long, and the file says it stays provisional
    other = tmp_path / "other"
    pool = HangPool()
    book = _book(other, pool)
    book.until = time.monotonic() + 30.0
    assert book.accept(sig, case, hang(12.0))
    assert 25.0 < pool.timeouts[0] <= 30.0
    assert json.loads((other / f"{sig}.json").read_text())["stage"] == "provisional"


def test_the_hunt_set_names_planted_files_and_prefixes_of_its_targets():
    from fuzzshard.session.hunt import load_set, pick, table

    folder, bugs = load_set()
    assert folder == PLANTED and len(bugs) >= 10
    for bug in bugs:
        prefixes = (bug.expect,) if isinstance(bug.expect, str) else bug.expect  # a tuple: any of them
        assert (folder / bug.setup).is_file() and all(p.startswith(f"{bug.target}.") for p in prefixes)
    corners = {b.name for b in pick(bugs, "ckpt_reshard,hang,crash_w3,fsdp2_hsdp")}
    assert corners == {"ckpt_reshard_swap", "hang_in_adagrad", "crash_w3_rprop", "fsdp2_hsdp_exp_avg_sq"}
    rows = [{"bug": "crash_w3_rprop", "seconds": s, "startup": 5.0} for s in (4.0, None, 10.0)]
    text = table([b for b in bugs if b.name == "crash_w3_rprop"], rows, [1, 2, 3], 60.0)
    assert "crash_w3_rprop |    4.0 |    >60 |   10.0 |   10.0 |   >60 |   2/3" in text


def test_a_case_drawn_again_is_answered_with_its_verdict_not_run_again(tmp_path, monkeypatch):
    """Hypothesis draws the same case more than once (a weighted choice's copies, its mutations): a case is
    deterministic, so the session runs it once and answers again with the verdict it had."""
    import hypothesis.strategies as st

    import fuzzshard.strategies as fst
    two = [simple_case(1, optim="Adam"), simple_case(1, optim="RMSprop")]
    monkeypatch.setattr(fst, "cases", lambda **kw: st.integers(0, 9).map(lambda i: two[i % 2]))
    pool = HangPool(finishes=True)
    pool.generation, pool.restarts, pool.stuck_seconds, pool.restart_seconds = 1, 0, 0.0, 0.0  # every case passes
    session = Session(pool, Draws(world_sizes=(1,)), SessionOptions(out=str(tmp_path), max_examples=20, seed=1),
                      progress=io.StringIO())
    session.run()
    ran = [c.to_json() for c, _ in pool.history]
    assert sorted(ran) == sorted(c.to_json() for c in two)  # each once
    assert session.stats.repeats > 0 and session.stats.cases == 2
