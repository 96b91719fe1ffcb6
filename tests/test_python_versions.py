"""pyproject says Python >= 3.10: every module must parse there, and the one
3.11 builtin the code uses (BaseExceptionGroup) comes from the backport."""
import ast
import glob
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SOURCES = sorted(glob.glob(str(ROOT / "fuzzshard" / "**" / "*.py"), recursive=True)
                 + glob.glob(str(ROOT / "strategies" / "*.py")) + glob.glob(str(ROOT / "ci" / "*.py")))


def test_pyproject_floor_and_backport():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10"' in text
    assert "exceptiongroup>=1.0; python_version < '3.11'" in text
    engine = (ROOT / "fuzzshard" / "session" / "engine.py").read_text()
    assert "from exceptiongroup import BaseExceptionGroup" in engine


def test_every_module_parses_as_python_3_10():
    for path in SOURCES:
        ast.parse(Path(path).read_text(), path, feature_version=(3, 10))


def test_every_module_compiles_under_a_real_python_3_10():
    found = glob.glob(str(Path.home() / ".pyenv/versions/3.10*/bin/python3.10")) + [shutil.which("python3.10")]
    py310 = next((p for p in found if p and subprocess.run([p, "-V"], capture_output=True).returncode == 0), None)
    if not py310:
        pytest.skip("no python3.10 on this machine")
    code = "import sys\nfor p in sys.argv[1:]:\n    compile(open(p).read(), p, 'exec')\n"
    r = subprocess.run([py310, "-c", code, *SOURCES], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
