"""The persistent pool: cases at every world size on one pool; a planted hang
and a planted crash become results and the session goes on."""
import time

import pytest

from cases import simple_case
from conftest import PLANTED
from fuzzshard.findings.record import signature
from fuzzshard.pool.options import PoolOptions
from fuzzshard.pool.runner import Pool


@pytest.fixture(scope="module")
def planted_pool():
    with Pool(3, options=PoolOptions(setup=[str(PLANTED / "hang_or_crash.py")], case_timeout=20)) as pool:
        yield pool


def test_one_pool_runs_every_world_size_and_mesh(fuzz_pool):
    restarts = fuzz_pool.restarts  # the pool is shared with other tests of the session
    for world in (1, 2, 3, 4, 2):
        assert fuzz_pool.run(simple_case(world)).verdict.to_dict() == {"status": "pass"}
    mesh_2x2 = simple_case(4, placements={"layers.0.weight": ["S0", "R"], "layers.2.weight": ["R", "R"]})
    mesh_2x2 = mesh_2x2.__class__(**{**mesh_2x2.__dict__, "mesh_shape": (2, 2)})
    assert fuzz_pool.run(mesh_2x2).verdict.to_dict() == {"status": "pass"}
    assert fuzz_pool.restarts == restarts


def test_invalid_config_is_rejected_not_reported(fuzz_pool):
    v = fuzz_pool.run(simple_case(2, optim="SGD", nesterov=True, momentum=0.0)).verdict
    assert v.status == "invalid" and "Nesterov" in v.extra["reason"]


def test_planted_hang_becomes_a_hang_result_and_the_session_goes_on(planted_pool):
    t0 = time.monotonic()
    v = planted_pool.run(simple_case(2, lr=0.123)).verdict
    assert v.oracle == "hang" and 1 in v.extra["stuck_ranks"], v  # rank 0 waits on rank 1 too
    # where each stuck rank waits (its stack, dumped on request) names the hang
    assert v.extra["where"][1].startswith("run._steps:"), v.extra["where"]
    # the signature names the kind of step rank 1 was in (optimizer.step), not fuzzshard's function
    assert v.extra["phase"][1] == "step" and signature(simple_case(2, lr=0.123), v).startswith("dtensor.hang.step"), v
    assert time.monotonic() - t0 < 20 + 15
    assert planted_pool.run(simple_case(2)).verdict.to_dict() == {"status": "pass"}
    assert planted_pool.restarts == 1


def test_planted_crash_becomes_a_crash_result_and_the_session_goes_on(planted_pool):
    v = planted_pool.run(simple_case(3, lr=0.321)).verdict
    assert v.oracle == "crash" and 1 in v.extra["dead_ranks"], v
    assert "SIGABRT" in v.error.type
    assert planted_pool.run(simple_case(3)).verdict.to_dict() == {"status": "pass"}


def test_a_rank_that_raises_alone_costs_a_short_wait_and_a_restart_not_the_case_timeout(fuzz_pool):
    """Row-wise Embedding(6, 5) over 4 ranks (a known torch bug): rank 3's shard is
    empty and it raises; ranks 0-2 wait in a collective for it. The verdict is rank 3's
    error with the others stuck, after GRACE_AFTER_ERROR, not the case timeout."""
    from fuzzshard.findings.record import KNOWN_DIR, load_finding
    from fuzzshard.pool.runner import GRACE_AFTER_ERROR

    case = load_finding(KNOWN_DIR / "dtensor.error.fwdbwd.RuntimeError.a009374a.json").case
    restarts, stuck = fuzz_pool.restarts, fuzz_pool.stuck_seconds
    r = fuzz_pool.run(case)
    v = r.verdict
    assert v.oracle == "error_parity" and v.rank == 3 and v.extra["stuck_ranks"] == [0, 1, 2], v
    assert signature(case, v) == "dtensor.error.fwdbwd.RuntimeError.a009374a"
    assert fuzz_pool.restarts == restarts + 1
    assert 0 < fuzz_pool.stuck_seconds - stuck < GRACE_AFTER_ERROR + 1.0 and r.seconds < fuzz_pool.case_timeout
    assert fuzz_pool.run(simple_case(4)).verdict.to_dict() == {"status": "pass"}  # the fresh set runs the next case


@pytest.fixture(scope="module")
def side_by_side_pool():
    with Pool(4, options=PoolOptions(setup=[str(PLANTED / "hang_or_crash.py")], case_timeout=20), placed=True) as pool:
        yield pool


def test_cases_side_by_side_run_on_disjoint_ranks_and_give_the_verdicts_they_give_alone(side_by_side_pool):
    """A placed case sees ranks 0..W-1 by every name torch has for a rank: a DCP
    round trip (its coordinator, the default group) passes at an offset, and a
    known DCP finding keeps its signature there."""
    import dataclasses

    from fuzzshard.case import Checkpoint
    from fuzzshard.findings.record import KNOWN_DIR, load_finding
    from fuzzshard.findings.judge import label

    pool = side_by_side_pool
    dcp = dataclasses.replace(simple_case(2, optim="Adam"),
                              checkpoint=Checkpoint(after=0, kind="dcp", world_size=1, mesh_shape=(1,)))
    known = load_finding(KNOWN_DIR / "dtensor.checkpoint.dcp.loaded.state.missing.json").case
    cases = [simple_case(1), dcp, known, simple_case(3)]
    side = pool.run_many(cases)
    assert [r.offset for r in side[:3]] == [0, 1, 3]  # the 3-rank case waits for three free ranks in a row
    alone = [pool.run(c) for c in cases]
    assert {r.offset for r in alone} == {0}
    assert side[1].verdict.to_dict() == {"status": "pass"}
    assert label(known, side[2].verdict) == "dtensor.checkpoint.dcp.loaded.state.missing"
    assert [label(c, r.verdict) for c, r in zip(cases, side)] == [label(c, r.verdict) for c, r in zip(cases, alone)]


def test_a_hang_beside_other_cases_costs_them_nothing(side_by_side_pool):
    """The cases beside a hang use other ranks and groups: they finish, then the pool restarts once."""
    pool = side_by_side_pool
    restarts = pool.restarts
    side = pool.run_many([simple_case(2, lr=0.123), simple_case(1), simple_case(2)])
    assert side[0].verdict.oracle == "hang" and 1 in side[0].verdict.extra["stuck_ranks"], side[0].verdict
    # the 1-rank case runs on rank 2, then the 2-rank one on ranks 2-3, while ranks 0-1 hang
    assert [(r.offset, r.verdict.to_dict()) for r in side[1:]] == [(2, {"status": "pass"}), (2, {"status": "pass"})]
    assert pool.restarts == restarts + 1


def test_a_session_on_a_placed_pool_draws_packs_and_counts_cases(side_by_side_pool, tmp_path):
    """--side-by-side: packs of up to four cases over world sizes 1-4, max_examples counting cases, not packs."""
    from fuzzshard.session.engine import Session
    from fuzzshard.session.options import Draws, SessionOptions

    session = Session(side_by_side_pool, Draws(optimizer_names=("SGD",), checkpoint=False),
                      SessionOptions(out=str(tmp_path), max_examples=12, seed=3))
    assert session.pack == 4
    assert not session.run()
    st = session.stats
    assert st.internal_errors == 0 and st.contaminated == 0
    assert 12 <= st.valid < 12 + 4  # the round stops at the first pack that reaches 12 valid cases
