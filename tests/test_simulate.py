"""--simulate (fuzzshard/session/simulate.py; the world: kernel/simulated.py; the real check: the last
step of a finding's life, findings/life.py's confirm_on_real): a case's ranks in one worker under LocalTensorMode; a simulated finding
counts only once real process groups fail the same way, else it is a LocalTensor limitation kept apart."""
import json

import pytest

from cases import simple_case
from conftest import PLANTED, run_cli
from fuzzshard.case import Case, mesh_shapes
from fuzzshard.findings.record import Finding, write_finding
from fuzzshard.findings.judge import judge
from fuzzshard.pool.options import PoolOptions
from fuzzshard.pool.runner import Pool

pytest.importorskip("torch.distributed._local_tensor")

BUG = PLANTED / "large_group_partial_averaged.py"


def wide_case(world: int) -> Case:
    """layers.0's input dim sharded: its matmul leaves a Partial sum over all ``world`` ranks."""
    return simple_case(world, optim="SGD", placements={"layers.0.weight": ["S1"], "layers.2.weight": ["R"]})


@pytest.fixture(scope="module")
def sim_pool():
    """One simulated worker with the planted bug that shows only on mesh dims of 5 or more ranks."""
    with Pool(1, options=PoolOptions(simulate=True, setup=[str(BUG)], case_timeout=120)) as pool:
        yield pool


def test_a_simulated_worker_runs_any_world_size_and_the_planted_bug_shows_from_5_ranks_on(sim_pool):
    assert sim_pool.run(wide_case(4)).verdict.to_dict() == {"status": "pass"}
    v = sim_pool.run(wide_case(5)).verdict
    assert v.status == "finding" and v.oracle == "parity", v
    assert v.first.quantity in ("loss", "grad") and v.first.step == 0


def test_a_simulated_finding_is_confirmed_on_real_processes_or_kept_apart_as_a_limitation(sim_pool, tmp_path):
    case = wide_case(5)
    j = judge(sim_pool, case)
    assert j.signature and j.signature.startswith("dtensor.parity."), j.label
    found = Finding(j.signature, case, j.verdict, deterministic=True, environment={}, stage="confirmed")
    write_finding(tmp_path, found, "# script\n")
    # not a finding: the same signature claimed for a case that passes on real processes
    bogus = Finding("dtensor.parity.SGD.forloop.simulated-only.param", simple_case(2, optim="SGD"), j.verdict,
                    deterministic=True, environment={}, stage="confirmed")
    write_finding(tmp_path, bogus, "# script\n")
    # too large to run for real here
    big = Finding("dtensor.parity.big", wide_case(12), j.verdict, deterministic=True, environment={}, stage="confirmed")
    write_finding(tmp_path, big, None)
    options = PoolOptions(setup=(str(BUG),), simulate=True)
    from fuzzshard.findings.life import confirm_on_real
    from fuzzshard.findings.real import LIMITS
    from fuzzshard.session.simulate import CheckPools

    result = confirm_on_real([found, bogus, big], tmp_path, CheckPools(options))
    assert result == {"confirmed": [found.signature], "limits": [bogus.signature], "simulated_only": [big.signature]}
    data = json.loads((tmp_path / f"{found.signature}.json").read_text())
    assert data["simulation"]["real"]["signature"] == found.signature and data["simulation"]["real"]["world_size"] == 5
    assert not (tmp_path / f"{bogus.signature}.json").exists()
    limit = json.loads((tmp_path / LIMITS / f"{bogus.signature}.json").read_text())
    assert limit["simulation"]["real"]["status"] == "pass" and (tmp_path / LIMITS / f"{bogus.signature}.py").exists()
    assert json.loads((tmp_path / f"{big.signature}.json").read_text())["simulation"]["status"] == "simulated only"
    assert big.stage == "simulated only" and found.stage == "confirmed"  # what the FINDING line says (cli/fuzz.py)


def test_meshes_of_three_dims_are_drawn_only_when_asked():
    from hypothesis import HealthCheck, given, seed, settings

    import fuzzshard.strategies as fst

    assert mesh_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert mesh_shapes(8, 3)[-1] == (2, 2, 2) and all(len(m) <= 3 for m in mesh_shapes(64, 3))
    seen = {2: set(), 3: set()}
    for dims in (2, 3):
        @seed(0)  # seeded: an unseeded run of 40 drew no 2x2x2 mesh once (a CI run of the full suite)
        @settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(fst.cases(target="dtensor", world_sizes=[8], checkpoint=False, mesh_dims=dims))
        def draw(case):
            case.check_world()  # a 3-dim mesh is a possible case
            seen[dims].add(len(case.mesh_shape))

        draw()
    assert max(seen[2]) == 2 and 3 in seen[3]


def test_simulate_refuses_a_target_it_cannot_carry_and_says_why(tmp_path):
    r = run_cli("fuzz", "--simulate", "--target", "fsdp2", "--max-examples", 1, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert "--simulate runs dtensor, tp; not fsdp2 (docs/simulate.md says why)" in r.stderr, r.stderr


def _drawn(worlds, n: int, seed: int) -> list:
    """``n`` dtensor cases per world size as a simulated session draws them (meshes of up to 3 dims)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst

    out = []
    for w in worlds:
        @hseed(seed)
        @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target="dtensor", world_sizes=[w], checkpoint=False, mesh_dims=3))
        def draw(case):
            out.append(case)

        draw()
    return out


def _untraced(x):
    """A verdict without its tracebacks (the shortcuts add their own frames to them, nothing else)."""
    if isinstance(x, dict):
        return {k: _untraced(v) for k, v in x.items() if k != "traceback"}
    return [_untraced(v) for v in x] if isinstance(x, list) else x


def test_the_shortcuts_through_localtensor_change_no_verdict(monkeypatch):
    """simulate_fast.py's shortcuts give the verdicts torch's own loop gives: parity numbers, errors, passes."""
    cases = _drawn((5, 8, 12), 6, seed=7)
    verdicts = {}
    for shortcuts in ("1", "0"):
        monkeypatch.setenv("FUZZSHARD_SIMULATE_SHORTCUTS", shortcuts)
        with Pool(1, options=PoolOptions(simulate=True, case_timeout=120)) as pool:
            verdicts[shortcuts] = [_untraced(pool.run(c).verdict.to_dict()) for c in cases]
    assert {v["status"] for v in verdicts["0"]} >= {"pass", "finding"}
    assert verdicts["1"] == verdicts["0"]


def test_localtensors_own_errors_are_recognised_up_front_and_judged_on_real_processes(tmp_path):
    """Adafactor's p.norm(2).item() on a Shard(0) param whose norm is Partial: each simulated rank's own float,
    which LocalTensor cannot carry ("Non Tensor or int rank results must be equal for all ranks"). A
    simulated session sets such a case aside unshrunk (SimulatedBook); the real run judges it: on 5 gloo
    processes it is the known dtensor-item-on-partial-returns-local bug (silent), so a limitation, no finding."""
    from fuzzshard.findings.life import confirm_on_real
    from fuzzshard.findings.localtensor import local_tensor_error
    from fuzzshard.findings.real import LIMITS
    from fuzzshard.session.simulate import CheckPools, SimulatedSession

    case = simple_case(5, optim="Adafactor", foreach=True)
    with Pool(1, options=PoolOptions(simulate=True, case_timeout=120)) as pool:
        j = judge(pool, case)
    assert "Non Tensor or int rank results must be equal" in j.verdict.error_record.message, j.verdict
    assert local_tensor_error(j.verdict)

    class Stats:
        contaminated = 0
    book = SimulatedSession.book_class(None, tmp_path, Stats(), known={}, progress=open("/dev/null", "w"))
    assert book.accept(j.signature, case, j.verdict) is False  # not raised to Hypothesis: nothing shrinks it
    assert book.accept(j.signature, simple_case(6, optim="Adafactor", foreach=True), j.verdict) is False
    held = book.set_aside[j.signature]
    assert held[0] is case and held[3] == 2 and not book.tracks  # the smaller case kept, both hits counted

    pools = CheckPools(PoolOptions(simulate=True))
    result = confirm_on_real([], tmp_path, pools, set_aside=book.set_aside)
    assert result["limits"] == [j.signature] and result["found"] == [] and result["set_aside"] == [j.signature]
    limit = json.loads((tmp_path / LIMITS / f"{j.signature}.json").read_text())
    assert limit["simulation"]["real"]["known"] and limit["simulation"]["real"]["status"] == "finding", limit
    # more ranks than run for real here: only its world size shrinks (simulated), to 8, where the real run judges it
    big = simple_case(12, optim="Adafactor", foreach=True)
    result = confirm_on_real([], tmp_path / "big", pools, set_aside={j.signature: (big, j.verdict, "why", 1)})
    limit = json.loads((tmp_path / "big" / LIMITS / f"{j.signature}.json").read_text())
    assert result["limits"] == [j.signature] and limit["case"]["world_size"] == 8, limit["removed"]
    assert limit["removed"] == ["world size 12 -> 8"] and limit["simulation"]["real"]["world_size"] == 8


def test_the_shortcuts_apply_on_this_torch_or_switch_themselves_off(monkeypatch):
    """Each private torch function the shortcuts replace or call is checked by name and parameters; on a
    release where one differs, installed() takes none (torch's own path) instead of breaking every case."""
    from fuzzshard.kernel import simulated_fast as simulate_fast

    assert simulate_fast.applicable() == list(simulate_fast.SHORTCUTS)  # 2.13.0, 2.14.1, 2.15.0 alike
    import torch.distributed._local_tensor as ltm

    before = ltm._for_each_rank_run_func
    monkeypatch.setattr(simulate_fast, "_applicable", list(simulate_fast.SHORTCUTS)[1:])  # as if one differed
    with simulate_fast.installed():
        assert ltm._for_each_rank_run_func is before
    monkeypatch.setattr(simulate_fast, "_applicable", None)
    with simulate_fast.installed():
        assert ltm._for_each_rank_run_func is not before
    assert ltm._for_each_rank_run_func is before


def test_a_new_fake_world_gets_no_mesh_of_the_last_one_from_dtensors_caches():
    """DeviceMesh equality ignores process groups, so DTensor's sharding cache handed a case the mesh of an
    earlier world of the same shape (destroyed groups: contaminated verdicts in warm simulated workers)."""
    import subprocess
    import sys

    script = """
import torch
from fuzzshard.kernel.simulated import SimulatedWorld
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
w = SimulatedWorld()
for n, shape in ((8, (2, 4)), (5, (5,)), (8, (2, 4))):
    with w.placed(0, n):
        mesh = w.mesh(n, shape)
        with w.job(n):
            out = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)] + [Replicate()] * (len(shape) - 1)) * 2 + 1
            print(out.device_mesh is mesh)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["True"] * 3, r.stdout + r.stderr


BUG6 = PLANTED / "partial_averaged_from_6_ranks.py"


def even_case(world: int, mesh=None, placements=None):
    """One Linear whose input dim (``world`` wide: an even shard per rank) is sharded over every rank: its matmul
    leaves a Partial sum over the whole mesh dim."""
    from dataclasses import replace

    from fuzzshard.case import Group, Layer, Model

    case = simple_case(world, optim="SGD", placements=placements or {"layers.0.weight": ["S1"]})
    model = Model("features", world, (Layer("linear", world, 4),))
    return replace(case, model=model, mesh_shape=mesh or (world,), groups=(Group(("layers.0.weight", "layers.0.bias")),))


# a drawn case a simulated session met the planted bug in (a LayerNorm's output grad, at 8 ranks)
LAYERNORM_FACE = {
    "target": "dtensor", "world_size": 7, "mesh_shape": [7], "batch": 1, "seq": 1, "dtype": "float32",
    "model": {"input": "features", "d_in": 3, "buffer": True, "layers": [
        {"kind": "conv1d", "d_in": 3, "d_out": 3, "bias": False}, {"kind": "layernorm", "d_in": 3, "d_out": 3},
        {"kind": "linear", "d_in": 3, "d_out": 8, "bias": False}, {"kind": "layernorm", "d_in": 8, "d_out": 8}]},
    "optim": {"name": "ASGD", "tensor_lr": "1d", "kwargs": {"alpha": 0.75, "foreach": True, "lambd": 0.01, "lr": 0.1,
                                                             "maximize": True, "t0": 1000000.0, "weight_decay": 0.01}},
    "groups": [{"params": ["layers.2.weight", "layers.3.bias", "layers.1.bias"]}, {"params": ["layers.1.weight"]},
               {"params": ["layers.0.conv.weight", "layers.3.weight"]}],
    "schedule": [{"set_to_none": False}],
    "target_options": {"placements": {"layers.2.weight": ["S0"]}},
}


def test_one_bug_met_in_two_modules_at_other_world_sizes_is_one_finding_at_the_least_world(tmp_path):
    """The planted bug that needs 6 ranks on one mesh dim, met as two findings: a Linear's forward on a 2-D mesh
    of 16 ranks ([2, 8], the bug on mesh dim 1, whose placement the session's reducer cuts away going 1-D) and a
    Linear's output grad at 7 ranks (a LayerNorm's at 8). Each is shrunk, simulated, as far as its own
    signature allows (6 ranks on a 1-D mesh) and confirmed on real processes; both begin at 6 ranks (and pass
    at 5), so they are one bug: one file, whose case is the least case that fails, ``removed`` says how it
    got there, and the other is its face."""
    from fuzzshard.findings.life import confirm_on_real
    from fuzzshard.findings.reduce import WORLD, edits
    from fuzzshard.session.simulate import CheckPools

    big = even_case(16, (2, 8), {"layers.0.weight": ["R", "S1"]})
    # the one shrinker's world pass: the fewest ranks first, a 1-D mesh keeping mesh dim 0's placements, or
    # mesh dim 1's (its own edit: the planted bug's Partial sum lives on dim 1)
    assert [what for what, _ in edits(big, WORLD)][:3] == \
        ["world size 16 -> 1", "world size 16 -> 1; mesh [2, 8] -> [1]", "world size 16 -> 2"]
    norm = Case.from_dict(LAYERNORM_FACE)
    with Pool(1, options=PoolOptions(simulate=True, setup=[str(BUG6)], case_timeout=120)) as pool:
        j, k = judge(pool, big), judge(pool, norm)
    # the LayerNorm's output grad is made by the backward of the Linear that read it (kernel/localize.py names that)
    assert (j.signature, k.signature) == ("dtensor.parity.forward.Linear", "dtensor.parity.backward.Linear")
    f = Finding(j.signature, big, j.verdict, environment={}, stage="confirmed", removed=["world size 32 -> 16"])
    g = Finding(k.signature, norm, k.verdict, environment={}, stage="confirmed")
    for found in (f, g):
        write_finding(tmp_path, found, "# script\n")
    result = confirm_on_real([f, g], tmp_path, CheckPools(PoolOptions(setup=(str(BUG6),), simulate=True)),
                             optimizer_names=["SGD"])
    assert result == {"confirmed": [j.signature], "limits": [], "simulated_only": [],
                      "folded": {k.signature: j.signature}}, result
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"{j.signature}.json"]
    data = json.loads((tmp_path / f"{j.signature}.json").read_text())
    assert (data["case"]["world_size"], data["case"]["mesh_shape"]) == (6, [6]), data["case"]
    assert data["case"]["target_options"]["placements"]["layers.0.weight"] == ["S1"]  # mesh dim 1's, kept
    assert data["removed"] == ["world size 32 -> 16", "world size 16 -> 6", "mesh [2, 8] -> [6]"]
    assert data["simulation"]["real"] == {**data["simulation"]["real"], "signature": j.signature, "world_size": 6}
    assert "torchrun --nproc-per-node 6 " in (tmp_path / f"{j.signature}.py").read_text()  # the script too
    rows = {(r["dimension"], r["value"]): r["outcome"] for r in data["generalization"]}
    assert rows["world size (1-D mesh)", "5"] == "passes" and rows["world size (1-D mesh)", "6"] == "fails"
    # the other face: its own least case, confirmed on real processes too, kept in the file
    assert data["faces"] == [k.signature]
    (face,) = data["simulation"]["folded"]
    assert face["signature"] == k.signature and face["case"]["world_size"] == 6 and face["onset"] == 6
    assert face["simulation"]["real"]["signature"] == k.signature


def test_replay_runs_a_finding_larger_than_real_runs_here_simulated_never_as_32_processes(tmp_path, monkeypatch,
                                                                                         capsys):
    """`fuzzshard replay` of a W=32 simulated-only finding: one simulated worker, the recorded signature (exit 1);
    a W=32 case it cannot simulate (a checkpoint): one line, exit 2, no worker started."""
    from dataclasses import replace

    from fuzzshard.case import Checkpoint
    from fuzzshard.cli import _parser, common, replay

    case = even_case(32)
    with Pool(1, options=PoolOptions(simulate=True, setup=[str(BUG6)], case_timeout=120)) as pool:
        j = judge(pool, case)
    assert j.signature == "dtensor.parity.forward.Linear", j.label
    path, _ = write_finding(tmp_path, Finding(j.signature, case, j.verdict, stage="simulated only"), None)
    started = []
    real_start = replay.start_pool
    monkeypatch.setattr(replay, "start_pool", lambda args, size, **kw: started.append((size, args.simulate))
                        or real_start(args, size, **kw))
    monkeypatch.setattr(common, "run_setup", lambda path: None)  # the planted bug in the workers, not in pytest's
    assert replay.run(_parser().parse_args(["replay", str(path), "--worker-setup", str(BUG6)])) == 1
    out = capsys.readouterr()
    assert f"FAIL: {j.signature}" in out.out and "replaying simulated (32 ranks" in out.err, out
    assert started == [(1, True)]
    ck = replace(case, checkpoint=Checkpoint(after=0, kind="dcp", world_size=32, mesh_shape=(32,),
                                             target_options=case.target_options))
    bad, _ = write_finding(tmp_path / "ck", Finding(j.signature, ck, j.verdict), None)
    r = run_cli("replay", bad)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "32 ranks, more than the 8 real processes" in r.stderr and "its checkpoint is not simulated" in r.stderr


REPLICA_BUG = PLANTED / "dtensor_replica_step_twice.py"


def replicated_case(world: int, mesh=None, **kwargs) -> Case:
    """Every param Replicate on every mesh dim (the planted replica bug's corner)."""
    from dataclasses import replace

    mesh = mesh or (world,)
    case = simple_case(world, optim="SGD", placements={"layers.0.weight": ["R"] * len(mesh)})
    return replace(case, mesh_shape=mesh, **kwargs)


def test_the_replica_oracle_runs_simulated_each_rank_its_own_copy_and_finds_what_real_processes_find(tmp_path,
                                                                                                  monkeypatch):
    """Each simulated rank's copy of a replicated DTensor is its own tensor of a LocalTensor: each rank digests
    its own, the digests ride LocalTensor's all-gather and the copies of a value that differs are handed over
    per rank (gather._all_gather_objects). The planted bug (a Replicate param stepped twice on every rank but
    the mesh's first) is found simulated at 5 and 8 ranks (1-, 2- and 3-dim meshes) as dtensor.replica.param,
    the very record 5 real gloo processes give. Where the diverged replicas then meet a float of the loss
    (ReduceLROnPlateau), LocalTensor raises its own error (real ranks each take their own float: the replica
    finding): set aside, its real check meets the finding already written, whose file is kept as it is."""
    from fuzzshard.case import LRScheduler
    from fuzzshard.findings import localtensor, real as real_check
    from fuzzshard.findings.life import confirm_on_real
    from fuzzshard.session.simulate import CheckPools

    cases = [replicated_case(5), replicated_case(8, (2, 4)), replicated_case(8, (2, 2, 2))]
    plateau = replicated_case(5, lr_scheduler=LRScheduler("ReduceLROnPlateau", {"patience": 0}))
    with Pool(1, options=PoolOptions(simulate=True, setup=[str(REPLICA_BUG)], case_timeout=120)) as pool:
        judged = [judge(pool, c) for c in cases]
        late = judge(pool, plateau)
    with Pool(5, options=PoolOptions(setup=[str(REPLICA_BUG)], case_timeout=120)) as pool:
        real, real_late = judge(pool, cases[0]), judge(pool, plateau)
    assert [j.signature for j in judged] == ["dtensor.replica.param"] * 3, [j.label for j in judged]
    for j, c in zip(judged, cases):
        first = j.verdict.first
        assert (first.step, first.extra["base_rank"], first.extra["replicas"]) == (0, 0, [[0], list(range(1, c.ranks))])
    assert real.signature == judged[0].signature and real.verdict.first == judged[0].verdict.first
    assert localtensor.local_tensor_error(late.verdict) and "float(loss)" in late.verdict.error_record.traceback
    assert real_late.signature == judged[0].signature

    found = Finding(judged[0].signature, cases[0], judged[0].verdict, deterministic=True, environment={},
                    stage="confirmed")
    write_finding(tmp_path, found, "# script\n")
    before = (tmp_path / f"{found.signature}.json").read_text()
    monkeypatch.setattr(real_check, "judge_for_real", lambda case, pools, known: (
        real_late, {}, {"signature": real_late.signature, "status": "finding", "world_size": 5}))
    pools = CheckPools(PoolOptions(setup=(str(REPLICA_BUG),), simulate=True))
    result = confirm_on_real([], tmp_path, pools, set_aside={late.signature: (plateau, late.verdict, "why", 1)})
    assert result["met"] == {late.signature: found.signature} and not result["found"], result
    assert (tmp_path / f"{found.signature}.json").read_text() == before  # not overwritten by the unshrunk case
