"""Bring your own optimizer, model and parallelism from one file. examples/ortho_momentum.py (a
Muon-style optimizer that orthogonalizes the full matrix of a sharded param)
trains like its unsharded self, and its planted bug (orthogonalizing each
rank's local shard) is found by search, shrunk, written, and replays: through
fuzzshard and standalone under torchrun, failing with it and passing without."""
import json
import os
import re
from pathlib import Path

from conftest import run_cli, torchrun

EXAMPLE = Path(__file__).parent.parent / "examples" / "ortho_momentum.py"
ARGS = ["--plugin", EXAMPLE, "--optimizers", "OrthoMomentum", "--target", "dtensor", "--world-sizes", "1,2",
        "--checkpoints", "none", "--seed", 3]  # packed (the default): seed 0 shrank to 3 layers, seed 3 to 1


def _with_bug(monkeypatch):
    monkeypatch.setenv("ORTHO_MOMENTUM_BUG", "local_shard")  # run_cli's children inherit it


def test_a_users_optimizer_from_one_file_is_fuzzed_and_its_planted_bug_found(tmp_path, monkeypatch):
    out = tmp_path / "out"
    clean = run_cli("fuzz", *ARGS, "--max-examples", 15, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]  # no false positive on the correct optimizer
    assert re.search(r"passing cases by optimizer \(for-loop·foreach·fused\): OrthoMomentum \d+", clean.stderr)

    _with_bug(monkeypatch)
    r = run_cli("fuzz", *ARGS, "--max-examples", 40, "--out", out)
    sig = "dtensor.parity.OrthoMomentum.forloop.param"
    path = out / f"{sig}.json"
    assert r.returncode == 1 and path.exists(), r.stderr[-3000:]
    finding = json.loads(path.read_text())
    case = finding["case"]
    assert finding["stage"] == "confirmed" and case["world_size"] == 2  # one rank holds the whole matrix
    assert len(case["model"]["layers"]) == 1 and len(case["schedule"]) == 1, case  # shrunk
    buggy = run_cli("replay", path, "--plugin", EXAMPLE)
    assert buggy.returncode == 1 and f"FAIL: {sig}" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    script, elsewhere = path.with_suffix(".py"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    standalone = torchrun(script, 2, "--setup", EXAMPLE, cwd=elsewhere)
    assert standalone.returncode != 0 and "FINDING" in standalone.stdout, standalone.stdout + standalone.stderr[-2000:]

    monkeypatch.delenv("ORTHO_MOMENTUM_BUG")
    fixed = run_cli("replay", path, "--plugin", EXAMPLE)
    assert fixed.returncode == 0 and f"PASS: {path} no longer fails ({sig})" in fixed.stdout, fixed.stdout
    ok = torchrun(script, 2, "--setup", EXAMPLE, cwd=elsewhere)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


TITAN = Path(__file__).parent.parent / "examples" / "titan_parallelize.py"


def test_a_users_model_and_parallelism_from_one_file_are_fuzzed_and_a_tp_bug_found(tmp_path, monkeypatch):
    """examples/titan_parallelize.py (torchtitan-style TP + FSDP2 over
    examples/tiny_llm.py's Llama-style decoder) as the target ``titan``: its
    planted bug (the MLP's row-wise w2 averages its partial sums over the TP
    ranks) is found, shrunk to one block on a 2 x 2 mesh, and replays from the
    finding alone (the plugin recorded in it) and standalone; without the bug
    the same case passes."""
    out = tmp_path / "out"
    monkeypatch.setenv("TITAN_BUG", "rowwise_avg")
    r = run_cli("fuzz", "--plugin", TITAN, "--target", "titan", "--world-sizes", 4, "--optimizers", "SGD,Adam",
                "--checkpoints", "none", "--seed", 0, "--max-examples", 40, "--out", out)
    found = sorted(out.glob("titan.parity.*.json"))
    assert r.returncode == 1 and found, r.stderr[-3000:]
    finding = json.loads(found[0].read_text())
    case, sig = finding["case"], finding["signature"]
    assert finding["stage"] == "confirmed" and finding["environment"]["plugins"] == [str(TITAN.resolve())]
    assert case["model"]["factory"] == "tiny_llm" and case["model"]["sizes"]["n_layers"] == 1, case  # one block
    assert case["mesh_shape"] == [2, 2] and case["target_options"]["tp"] is True and len(case["schedule"]) == 1
    buggy = run_cli("replay", found[0])  # no --plugin: the finding names it
    assert buggy.returncode == 1 and f"FAIL: {sig}" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    standalone = torchrun(found[0].with_suffix(".py"), 4, "--setup", TITAN, cwd=tmp_path)
    assert standalone.returncode != 0 and "FINDING" in standalone.stdout, standalone.stdout + standalone.stderr[-2000:]
    monkeypatch.delenv("TITAN_BUG")
    fixed = run_cli("replay", found[0])
    assert fixed.returncode == 0 and f"({sig})" in fixed.stdout, fixed.stdout + fixed.stderr[-2000:]
