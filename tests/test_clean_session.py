"""No false positives: a fuzz session over every optimizer on unmodified torch
finds nothing new (every finding it meets is a known torch bug)."""
from fuzzshard.engine import Session
from fuzzshard.strategies.optimizers import default_optimizers


def test_clean_session_over_every_optimizer_finds_nothing_new(fuzz_pool, tmp_path):
    session = Session(fuzz_pool, ["dtensor"], tmp_path, world_sizes=[1, 2, 3, 4], max_examples=120, seed=2024)
    findings = session.run()
    assert not findings, "\n".join(f"{f.signature}: {f.verdict.get('first') or f.verdict.get('error')}" for f in findings)
    st = session.stats
    assert st.internal_errors == 0
    assert st.valid >= 100
    # every default optimizer really ran to a parity verdict, not only into known errors
    assert set(st.passed_by_optimizer) == set(default_optimizers()), st.passed_by_optimizer
