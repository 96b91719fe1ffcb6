"""Without torchao (hidden by tests/data/no_torchao's sitecustomize, as if not installed): --ao's draws are off with
one line saying why, and a session runs. The suite's ao tests skip then (test_ao*.py's importorskip)."""
import os
import subprocess
import sys
from pathlib import Path

from fuzzshard.kernel.float8 import FLOAT8_OFF

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "data" / "no_torchao"


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_the_shim_hides_torchao():
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u; assert u.find_spec('torchao') is None\n"
                        "try:\n import torchao\nexcept ImportError: print('hidden')"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "hidden", r.stdout + r.stderr[-2000:]


def test_an_ao_session_without_torchao_says_its_draws_are_off_once_and_runs(tmp_path):
    cmd = [sys.executable, "-m", "fuzzshard", "fuzz", "--target", "fsdp2", "--ao", "--max-examples", "3",
           "--world-sizes", "1", "--seed", "1", "--loop", "none", "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stderr.count(FLOAT8_OFF) == 1, r.stderr[-3000:]
