import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = Path(__file__).parent / "planted"


def run_cli(*args, cwd=None, timeout=900, setup=None):
    """Run ``python -m fuzzshard ARGS`` and return the CompletedProcess."""
    cmd = [sys.executable, "-m", "fuzzshard", *map(str, args)]
    if setup:
        cmd += ["--worker-setup", str(PLANTED / setup)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def torchrun(script, nproc, *args, cwd, timeout=300):
    """Run a standalone repro script under torchrun, with an env free of fuzzshard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUZZSHARD")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def cli():
    return run_cli
