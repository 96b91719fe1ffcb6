"""Bring your own optimizer from one file: examples/ortho_momentum.py (a
Muon-style optimizer that orthogonalizes the full matrix of a sharded param)
trains like its unsharded self, and its planted bug (orthogonalizing each
rank's local shard) is found by search, shrunk, written, and replays: through
fuzzshard and standalone under torchrun, failing with it and passing without."""
import json
import os
from pathlib import Path

from conftest import run_cli, torchrun

EXAMPLE = Path(__file__).parent.parent / "examples" / "ortho_momentum.py"
ARGS = ["--plugin", EXAMPLE, "--optimizers", "OrthoMomentum", "--target", "dtensor", "--world-sizes", "1,2",
        "--checkpoints", "none", "--seed", 0]


def _with_bug(monkeypatch):
    monkeypatch.setenv("ORTHO_MOMENTUM_BUG", "local_shard")  # run_cli's children inherit it


def test_a_users_optimizer_from_one_file_is_fuzzed_and_its_planted_bug_found(tmp_path, monkeypatch):
    out = tmp_path / "out"
    clean = run_cli("fuzz", *ARGS, "--max-examples", 15, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]  # no false positive on the correct optimizer
    assert "passing cases by optimizer: OrthoMomentum" in clean.stderr

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
