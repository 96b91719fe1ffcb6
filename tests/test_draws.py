"""The built-in targets' draws stay what they were (see tests/draws.py).

In a fresh interpreter: Hypothesis mixes literals of the imported modules into
what it generates, so a draw depends on what else the process has imported."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_the_strategies_draw_what_they_drew():
    pinned = json.loads((HERE / "data" / "draw_digests.json").read_text())
    r = subprocess.run([sys.executable, str(HERE / "draws.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    now = json.loads(r.stdout)
    if now["hypothesis"] != pinned["hypothesis"]:
        pytest.skip(f"digests pinned with Hypothesis {pinned['hypothesis']}, running {now['hypothesis']}: "
                    "regenerate with `python tests/draws.py --write`")
    assert now == pinned


def test_compile_is_drawn_only_when_asked_and_then_in_every_fsdp2_case():
    """--compile: every fsdp2 case compiles its blocks, before or after
    fully_shard, half of them the step too; without it nothing compiles."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst

    seen = {True: [], False: []}
    for asked in (True, False):
        @hseed(0)
        @settings(max_examples=30, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target="fsdp2", world_sizes=[1, 2], models=("decoder",), compile=asked))
        def collect(case):
            seen[asked].append(case.target_options)

        collect()
    assert {o.get("compile") for o in seen[True]} == {"before", "after"}
    assert {bool(o.get("compile_step")) for o in seen[True]} == {True, False}
    assert not any(o.get("compile") or o.get("compile_step") for o in seen[False])
