"""Sessions: what draws cases and drives the pool.

engine.py runs a fuzz session (Hypothesis over the strategies, steered by schedule.py's coverage); soak.py runs
it for hours across cells and nodes; simulate.py runs each case in one process under LocalTensor; bench.py and
hunt.py measure its speed; database.py keeps Hypothesis's examples (in redis for a soak)."""
