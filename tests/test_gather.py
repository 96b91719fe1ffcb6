"""kernel/gather.py: one collective for a step's full copies, bit for bit full_tensor()'s."""
from pathlib import Path

from conftest import torchrun

DATA = Path(__file__).parent / "data"


def test_batched_full_copies_equal_full_tensor_and_a_bad_shard_falls_back_on_every_rank(tmp_path):
    """... and the replica comparison in the same pass: a one-ulp drift on the last rank, a hyperparameter
    on rank 0, a state tensor rank 0 lacks, each named on rank 0 with the ranks holding each copy."""
    r = torchrun(DATA / "gather_check.py", 3, cwd=tmp_path)  # 3 ranks: uneven and empty shards
    assert r.returncode == 0 and r.stdout.count("OK") == 3, r.stdout + r.stderr[-3000:]
