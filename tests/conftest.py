import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = Path(__file__).parent / "planted"

# The slow tier: run with `pytest -m slow` (or `-m "slow or not slow"` for everything); `pytest` alone, what CI
# runs, leaves it out to stay within its budget on 2 cores. Each entry says what in the default tier proves
# the same thing. Keyed by node id (a prefix or a parametrized id), measured with --durations.
SLOW = {
    "test_planted.py::test_planted_tp_bug_in_the_decoder_is_found_shrunk_to_one_block_and_replays":
        "two decoder transformers at world size 4 on a 2x2 mesh, 4-6 min each: TP stays in the default tier through "
        "test_fsdp2_tensor_parallel_trains_in_parity_and_a_tp_grad_bug_is_caught (a hand-written TP case)",
    "test_planted.py::test_planted_bug_is_found_shrunk_and_replays_anywhere[last_shard_untouched]":
        "a second planted dtensor parity bug (2 min): skip_weight_decay proves the parity oracle on dtensor",
    "test_planted.py::test_planted_bug_is_found_shrunk_and_replays_anywhere[fsdp2_fp16_no_postdivide]":
        "world size 4 with mixed precision (2.5 min): fsdp2_skip_average proves fsdp2's parity",
    "test_planted.py::test_planted_sharded_scaler_found_inf_bug_is_found_from_a_partial_overflow_and_replays":
        "an fsdp2 session, two replays and two torchrun scripts (1-2.5 min): the plant is caught on fsdp1, fsdp2 "
        "and sharded_optim in the default tier by test_loop_targets.py's partial-overflow cases",
    "test_planted.py::test_two_planted_bugs_are_two_findings_each_one_file":
        "100 examples, each with a checkpoint: folding is unit-tested in test_generalize.py and by skip_weight_decay's faces",
    "test_plugin.py::test_a_users_model_and_parallelism_from_one_file_are_fuzzed_and_a_tp_bug_found":
        "a torchtitan-style TP + FSDP2 plugin on a decoder at world size 4 (4 min): plugins stay in the default tier "
        "through test_a_users_optimizer_from_one_file_is_fuzzed_and_its_planted_bug_found",
    "test_redis.py::test_a_second_run_replays_the_first_runs_failure_from_redis":
        "a fuzz session, then a soak that replays it: every database write is checked by the other redis tests",
    "test_redis.py::test_a_soak_goes_on_when_redis_goes_away": "a soak of up to 3 minutes",
    "test_ddp.py::test_no_sync_that_still_all_reduces_on_one_rank_is_caught":
        "two replays, one of them a hang that waits out a 15 s case timeout (40-70 s): the other ddp plants are "
        "caught in the default tier by test_ddp.py's replays, and hangs by test_planted.py's hang_in_adagrad",
    "test_soak.py::test_torchrun_soak_cells_span_nodes_and_a_lost_node_leaves_the_rest_going":
        "a torchrun soak over 3 processes (70 s and more): test_cells_share_findings... keeps soaks in the default tier",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.split("/")[-1].startswith(key) for key in SLOW):
            item.add_marker(pytest.mark.slow)


def run_cli(*args, cwd=None, timeout=900, setup=None):
    """Run ``python -m fuzzshard ARGS`` and return the CompletedProcess."""
    cmd = [sys.executable, "-m", "fuzzshard", *map(str, args)]
    if args and args[0] in ("fuzz", "soak") and "--loop" not in args:
        # the seeds of these tests were picked against the draws without the training loop (issue 38's
        # --loop, on by default): a test of the loop says --loop itself
        cmd += ["--loop", "none"]
    if setup:
        cmd += ["--worker-setup", str(PLANTED / setup)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def torchrun(script, nproc, *args, cwd, timeout=300):
    """Run a standalone repro script under torchrun, with an env free of fuzzshard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUZZSHARD")}
    # --standalone: a free port for each run (the default 29500 is shared by every torchrun at once, and two
    # xdist workers' scripts met there: one run's ranks failed to start, with nothing on stdout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script),
           *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def replay_clean_then_buggy(tmp_path, case, bug: str) -> str:
    """A hand-written case passes on clean torch and fails with ``bug``; the failing replay's output (the
    caller checks the signature in it: exit 1 alone is any finding)."""
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    clean = run_cli("replay", path)
    assert clean.returncode == 0, clean.stdout + clean.stderr[-2000:]
    buggy = run_cli("replay", path, setup=bug)
    assert buggy.returncode == 1, buggy.stdout + buggy.stderr[-2000:]
    return buggy.stdout


@pytest.fixture
def cli():
    return run_cli
