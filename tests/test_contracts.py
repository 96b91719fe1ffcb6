"""Documented refusals and deprecations, one torchrun each (see tests/contracts/)."""
from pathlib import Path

from conftest import torchrun

CONTRACTS = Path(__file__).parent / "contracts"


def test_zero_rejects_bad_params_and_fsdp1_optim_input_warns(tmp_path):
    r = torchrun(CONTRACTS / "rejects.py", 1, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-2000:]
