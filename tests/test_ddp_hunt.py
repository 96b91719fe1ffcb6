"""What bench --hunt needs to meet issue 47's plants (tests/planted/hunt.json): a hang met among a session's
first cases is seen under a derived limit (fuzzshard/session/engine.py), and a hunt entry may expect one of
several signature prefixes (a planted collective mismatch is a hang or a gloo abort)."""
import collections
import dataclasses
import types

from fuzzshard.case import Checkpoint
from fuzzshard.session.engine import EARLY_TIMEOUT_FLOOR, Session, _Round
from fuzzshard.session.hunt import first_sight, load_set

from test_ddp import ddp_case


def _session(passes: dict, seconds: dict, case_timeout: float = 120.0) -> Session:
    s = Session.__new__(Session)
    s._passes, s._pass_seconds = collections.Counter(passes), dict(seconds)
    s.pool = types.SimpleNamespace(case_timeout=case_timeout)
    return s


def test_a_hang_among_the_first_cases_gets_a_derived_limit_once_one_case_passed():
    case, rnd = ddp_case(microbatches=2), _Round()
    assert _session({}, {})._timeout(case, rnd) is None  # nothing passed: the full --case-timeout
    kind = (case.target, case.ranks, False)
    assert _session({kind: 1}, {kind: 0.5})._timeout(case, rnd) == EARLY_TIMEOUT_FLOOR  # 10 x 0.5 s, floored
    assert _session({kind: 1}, {kind: 5.0})._timeout(case, rnd) == 50.0
    assert _session({kind: 1}, {kind: 20.0})._timeout(case, rnd) is None  # at or past --case-timeout: the full one
    assert _session({kind: 3}, {kind: 0.5})._timeout(case, rnd) == 15.0  # three passed: the search limit, as before
    # a checkpoint case, a kind none of which passed yet: the slowest passing case of any kind is the measure
    with_ck = dataclasses.replace(case, checkpoint=Checkpoint(0, "full", 2, (2,), {}))
    assert _session({kind: 1}, {kind: 4.0})._timeout(with_ck, rnd) == 40.0


def test_the_no_sync_plant_is_hunted_as_a_hang_or_a_crash(tmp_path):
    _, bugs = load_set()
    bug = next(b for b in bugs if b.name == "ddp_no_sync_one_rank")
    assert bug.expect == ("ddp.hang.fwdbwd.all_reduce", "ddp.crash.Killed_by_SIGABRT.fwdbwd.all_reduce")
    (tmp_path / "ddp.checkpoint.dcp.loaded.state.missing.json").write_text("{}")
    (tmp_path / "ddp.crash.Killed_by_SIGABRT.fwdbwd.unpack_uncompressed_tensors_and_allreduce_ps.json").write_text("{}")
    assert first_sight(tmp_path, bug.expect) is None
    (tmp_path / "ddp.crash.Killed_by_SIGABRT.fwdbwd.all_reduce.json").write_text("{}")
    assert first_sight(tmp_path, bug.expect) == "ddp.crash.Killed_by_SIGABRT.fwdbwd.all_reduce.json"
