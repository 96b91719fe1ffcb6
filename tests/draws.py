"""The strategies' draws, pinned: for every built-in target, the to_json of
seeded draws hashed into one digest. Refactors of the strategies must keep
them (the example databases and the planted tests' seeds depend on them).

    python tests/draws.py --write    # after a deliberate change of the draws, or a Hypothesis upgrade
"""
import hashlib
import json
import sys
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from fuzzshard import targets

DIGESTS = Path(__file__).parent / "data" / "draw_digests.json"
TARGETS = targets.builtin()  # a new target's draws are pinned with the others (--write)
SEEDS, PER_SEED = 4, 25


def digest(target: str) -> str:
    import fuzzshard.strategies as fst

    h = hashlib.sha256()
    for s in range(SEEDS):
        @hseed(s)
        @settings(max_examples=PER_SEED, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target=target, world_sizes=[1, 2, 3, 4]))
        def collect(case):
            h.update(case.to_json().encode())

        collect()
    return h.hexdigest()


def current() -> dict:
    import hypothesis

    return {"hypothesis": hypothesis.__version__, **{t: digest(t) for t in TARGETS}}


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DIGESTS.write_text(json.dumps(current(), indent=2, sort_keys=True) + "\n")
    else:
        print(json.dumps(current(), indent=2, sort_keys=True))
