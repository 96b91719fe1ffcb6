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


def test_a_timed_session_turns_through_every_optimizer_and_implementation(tmp_path):
    """After its first round (free draws), each round of a timed session pins one
    optimizer x implementation in turn: a bug in a rarely drawn optimizer gets its
    turn. A count-bound session (--max-examples) draws freely, as before."""
    from hypothesis import HealthCheck, given, settings

    import fuzzshard.strategies as fst
    from fuzzshard.engine import Session
    from fuzzshard.strategies.optimizers import default_optimizers, implementations

    every = {(n, i) for n in default_optimizers() for i in implementations(n)}
    session = Session(None, ["dtensor"], tmp_path, duration=60.0, seed=7)
    assert session._pin("dtensor", 0) == {}  # round 0: free draws (and the example database's replays)
    session._deadline = 1.0  # as run() sets it
    pins = [session._pin("dtensor", r) for r in range(1, len(every) + 1)]
    assert {(p["optimizer_names"][0], p["implementation"]) for p in pins} == every
    assert Session(None, ["dtensor"], tmp_path, max_examples=10)._pin("dtensor", 3) == {}
    # a pinned round draws that optimizer and implementation only
    seen = set()

    @settings(max_examples=15, database=None, suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="dtensor", world_sizes=(1, 2), optimizer_names=["Adamax"], implementation="forloop"))
    def draw(case):
        seen.add((case.optim.name, case.optim.implementation))

    draw()
    assert seen == {("Adamax", "forloop")}


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
