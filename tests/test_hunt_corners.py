"""The planted bugs added for bench --hunt's corners (tests/planted/hunt.json)
show as the findings the hunt waits for, on a hand-written case each: the case
passes on clean torch and fails with the bug's signature (one replay each way;
the hunt itself is a benchmark, never a test)."""
import dataclasses

from cases import simple_case
from conftest import replay_clean_then_buggy

from fuzzshard.case import Optim, Step


def test_a_crash_that_needs_world_size_3_and_rprop(tmp_path):
    case = simple_case(3, placements={"layers.0.weight": ["R"], "layers.2.weight": ["R"]})  # Rprop's step on a
    case = dataclasses.replace(case, optim=Optim("Rprop", {"lr": 0.01, "foreach": False}))  # shard: a known bug
    out = replay_clean_then_buggy(tmp_path, case, "crash_w3_rprop.py")
    assert "dtensor.crash.Killed_by_SIGABRT" in out, out


def test_fsdp2_hsdp_2x2_exp_avg_sq_from_the_second_step(tmp_path):
    case = simple_case(4, optim="Adam", foreach=False)
    case = dataclasses.replace(case, target="fsdp2", mesh_shape=(2, 2), batch=4, schedule=(Step(), Step()),
                               target_options={"wrap": ["layers.0"], "reshard_after_forward": True})
    out = replay_clean_then_buggy(tmp_path, case, "fsdp2_hsdp_exp_avg_sq.py")
    assert "fsdp2.parity.Adam.forloop.state.exp_avg_sq" in out, out
