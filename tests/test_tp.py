"""The ``tp`` target: tensor parallelism alone (parallelize_module on a 1-D
mesh of all the ranks, no FSDP), its draws, and a planted TP bug found by a
fuzz session, shrunk, and replayed through fuzzshard and standalone."""
import json

from hypothesis import HealthCheck, given, settings

import fuzzshard.strategies as fst
from conftest import PLANTED, replays_clean, run_cli, torchrun


@settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=fst.cases(target="tp", world_sizes=[1, 2, 3, 4], models=("topologies", "decoder")))
def test_tp_draws_a_plan_on_a_1d_mesh_of_every_rank_and_the_whole_batch(case):
    """1-D meshes only, a plan of the model's own modules (fsdp2's TP drawing), no FSDP options; not data
    parallel: the batch is not drawn as a multiple of the ranks."""
    from fuzzshard.kernel.model import param_shapes

    assert case.mesh_shape == (case.world_size,)
    opts = case.target_options
    assert set(opts) <= {"tp", "sp", "loss_parallel"}, opts
    modules = {n.rsplit(".", 1)[0] for n in param_shapes(case.model)}
    assert set(opts["tp"]) <= modules | {"unused"} or case.model.factory == "decoder", opts
    if case.checkpoint:
        assert case.checkpoint.mesh_shape == (case.checkpoint.world_size,)


def test_planted_tp_bug_is_found_on_the_tp_target_shrunk_and_replays(tmp_path):
    """A RowwiseParallel Linear that adds its bias on every TP rank (tp x the
    bias in its output) is found by a short tp session, shrunk to one rowwise
    Linear with a bias on 2 ranks, and replays as itself through fuzzshard and
    standalone under torchrun; on unmodified torch the same case passes."""
    bug = "tp_rowwise_bias_per_rank.py"
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "tp", "--max-examples", 30, "--seed", 0, "--world-sizes", "1,2",
                "--optimizers", "SGD", "--checkpoints", "none", "--case-timeout", 60, "--out", out, setup=bug)
    assert r.returncode == 1, r.stderr[-3000:]
    found = sorted(out.glob("tp.parity.*.json"))
    assert len(found) == 1, f"{[p.name for p in out.iterdir()]}; stderr:\n{r.stderr[-3000:]}"
    finding = json.loads(found[0].read_text())
    sig, case = finding["signature"], finding["case"]
    assert sig.startswith("tp.parity.forward"), sig  # the rowwise Linear's own output is the first to differ
    assert finding["stage"] == "confirmed" and finding["deterministic"] is True
    assert case["target"] == "tp" and case["world_size"] == 2 and case["mesh_shape"] == [2], case
    assert list(case["target_options"]["tp"].values()) == ["rowwise"], case["target_options"]
    from fuzzshard.case import Case
    from fuzzshard.kernel.model import param_shapes

    (rowwise,) = case["target_options"]["tp"]
    assert f"{rowwise}.bias" in param_shapes(Case.from_dict(case).model), case["model"]  # what the bug adds
    assert finding["verdict"]["first"]["module"] == "Linear", finding["verdict"]["first"]
    buggy = run_cli("replay", found[0], setup=bug)
    assert buggy.returncode == 1 and f"FAIL: {sig}" in buggy.stdout, buggy.stdout
    replays_clean(found[0])
    script = found[0].with_suffix(".py")  # the straight-line script (scriptgen/tp.py): the plan written out
    assert "parallelize_module(model, mesh, {" in script.read_text() and "fully_shard" not in script.read_text()
    buggy = torchrun(script, 2, "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode != 0 and "FINDING" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(script, 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
