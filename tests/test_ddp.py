"""The ddp target (kernel/targets/ddp.py): DistributedDataParallel and replicate() with their flags,
no_sync accumulation, a gated residual, comm hooks, Join and the module state dict, replayed from
hand-written cases (seconds each); its planted bugs found by their signatures; its straight-line
script under torchrun with and without one."""
import dataclasses
from pathlib import Path

import pytest

from cases import simple_case
from conftest import PLANTED, replay_clean_then_buggy, replays_clean, run_cli, torchrun
from fuzzshard.case import CaseError, Checkpoint, Group, Layer, Model, Step
from fuzzshard.scriptgen import fallback_reason, straight_script


def ddp_case(**options):
    case = simple_case(2, optim="Adam")
    return dataclasses.replace(case, target="ddp", batch=4, schedule=(Step(),) * 3, target_options=options)


def gated_case(**options):
    """A residual block (layers.1) that each rank skips on a microbatch whose input sums above 0."""
    model = Model("features", 4, (Layer("linear", 4, 4), Layer("residual", 4, 4, children=(
        Layer("linear", 4, 4), Layer("act", act="tanh"))), Layer("linear", 4, 3)))
    names = ("layers.0.weight", "layers.0.bias", "layers.1.inner.0.weight", "layers.1.inner.0.bias",
             "layers.2.weight", "layers.2.bias")
    return dataclasses.replace(ddp_case(**options), model=model, groups=(Group(names),), batch=8)


CLEAN = {
    # params unused on some ranks and steps (the gate), accumulated under no_sync from the first step on
    "gate_no_sync": gated_case(ddp={"find_unused_parameters": True, "bucket_cap_mb": 1e-6}, gate="layers.1",
                               microbatches=2),
    "powersgd": ddp_case(hook={"name": "powersgd", "rank": 1, "start": 2, "feedback": True, "warm": True,
                               "min_rate": 0.0}),
    "uneven_join": ddp_case(ddp={"gradient_as_bucket_view": True}, uneven=[3, 1]),
    # replicate() saves without the module. prefix; the DDP wrapper it loads into at world size 1 wants it
    "replicate_module_ckpt": dataclasses.replace(ddp_case(replicate=True, microbatches=2),
                                                 checkpoint=Checkpoint(0, "module", 1, (1,), {})),
    # a CheckpointWrapper in between (FQNs gain _checkpoint_wrapped_module): DDP is told the ignored param by the
    # FQN it sees, the loop averages it by its plain one (a 10-minute --ac session met a KeyError there)
    "ac_wrapper_ignored": gated_case(ac=["layers.1"], ac_how="wrapper", ignore=["layers.1.inner.0.weight"]),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_ddp_features_train_in_parity(tmp_path, name):
    path = tmp_path / "case.json"
    path.write_text(CLEAN[name].to_json())
    replays_clean(path)


def test_ddp_rules_refuse_what_ddp_documents():
    with pytest.raises(CaseError, match="static_graph"):
        gated_case(ddp={"static_graph": True, "find_unused_parameters": True}, gate="layers.1").check()
    with pytest.raises(CaseError, match="bf16_compress_hook"):
        ddp_case(hook={"name": "bf16"}).check()
    with pytest.raises(CaseError, match="PowerSGD"):
        ddp_case(hook={"name": "powersgd", "rank": 1, "start": 1, "feedback": True, "warm": False,
                       "min_rate": 0.0}).check()
    with pytest.raises(CaseError, match="equal microbatches"):
        ddp_case(microbatches=3).check()


def test_static_graph_bucket_that_skips_a_param_is_caught(tmp_path):
    """Under static_graph, after the first iteration, one param keeps each rank's own grad."""
    buggy = replay_clean_then_buggy(tmp_path, ddp_case(ddp={"static_graph": True}),
                                    "ddp_static_bucket_skips_param.py")
    assert "FAIL: ddp.parity.grad" in buggy and "grad of layers.0.weight after step 1" in buggy, buggy


def test_compress_hook_that_casts_back_before_dividing_is_caught(tmp_path):
    """fp16_compress_hook whose bucket keeps the sum: far past float16's derived rounding bound."""
    buggy = replay_clean_then_buggy(tmp_path, ddp_case(hook={"name": "fp16"}),
                                    "ddp_compress_cast_back_before_divide.py")
    assert "FAIL: ddp.parity.grad" in buggy and "after step 0" in buggy and "(comm hook fp16)" in buggy, buggy


def test_no_sync_that_still_all_reduces_on_one_rank_is_caught(tmp_path):
    """Rank 1 all-reduces inside no_sync: its collectives no longer pair with rank 0's (a hang)."""
    path = tmp_path / "case.json"
    path.write_text(ddp_case(microbatches=2).to_json())
    replays_clean(path)
    buggy = run_cli("replay", path, "--case-timeout", 15, setup="ddp_no_sync_one_rank.py")
    assert buggy.returncode == 1 and "FAIL: ddp.hang.fwdbwd." in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]


def test_ddp_script_finds_the_planted_bucket_skip_and_passes_without(tmp_path):
    case = ddp_case(ddp={"static_graph": True, "bucket_cap_mb": 1e-6}, microbatches=2, synced_first=1)
    src = straight_script(case, "ddp")
    assert src is not None and src.count("\n") < 150, fallback_reason(case)
    assert "ddp.no_sync()" in src and "static_graph=True" in src
    (tmp_path / "repro.py").write_text(src)
    buggy = torchrun(tmp_path / "repro.py", 2, "--setup", PLANTED / "ddp_static_bucket_skips_param.py", cwd=tmp_path)
    assert buggy.returncode == 1 and "step 1 grad layers.0.weight" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_ddp_script_falls_back_where_the_bound_is_the_kernels():
    assert "fp16" in fallback_reason(ddp_case(hook={"name": "fp16"}))
    assert "gate" in fallback_reason(gated_case(ddp={"find_unused_parameters": True}, gate="layers.1"))
    assert fallback_reason(ddp_case(replicate=True, microbatches=2)) is None


def powersgd_resume_case(kind="full"):
    """PowerSGD with error feedback and warm start from step 2, its state saved after step 2 (two PowerSGD
    iterations in: an error per bucket, P and Q) and loaded into a fresh state for steps 3-4."""
    hook = {"name": "powersgd", "rank": 1, "start": 2, "feedback": True, "warm": True, "min_rate": 0.0,
            "resume": True}
    options = {"ddp": {"find_unused_parameters": True, "bucket_cap_mb": 4e-5}, "hook": hook}
    case = dataclasses.replace(ddp_case(**options), schedule=(Step(),) * 5)
    return dataclasses.replace(case, checkpoint=Checkpoint(2, kind, 2, (2,), {**options, "hook": dict(hook)}))


def test_powersgd_state_round_trip_rules():
    powersgd_resume_case().check()
    case = powersgd_resume_case()
    with pytest.raises(CaseError, match="PowerSGD's state round-tripped"):  # another world on the loading side
        dataclasses.replace(case, checkpoint=dataclasses.replace(case.checkpoint, world_size=1, mesh_shape=(1,))).check()
    with pytest.raises(CaseError, match="PowerSGD's state round-tripped"):  # buckets rebuilt after the first step
        static = {**case.target_options, "ddp": {"static_graph": True}}
        dataclasses.replace(case, target_options=static,
                            checkpoint=dataclasses.replace(case.checkpoint, target_options=dict(static))).check()


def test_powersgd_error_dict_dropped_at_load_is_caught(tmp_path):
    """The resumed run's error feedback starts from zeros: the loaded state differs from the saved, and the
    resumed run's reduction from the uninterrupted one's."""
    buggy = replay_clean_then_buggy(tmp_path, powersgd_resume_case(), "ddp_powersgd_error_dropped_at_load.py")
    assert "FAIL: ddp.checkpoint.full.loaded.powersgd.error_dict" in buggy, buggy


def test_powersgd_resumed_run_that_leaves_the_uninterrupted_one_is_caught(tmp_path):
    """The loaded state is the saved one, but the resumed run reduces otherwise (no warm start): the resumed
    oracle, bucket by bucket against the uninterrupted state."""
    buggy = replay_clean_then_buggy(tmp_path, powersgd_resume_case("dcp"), "ddp_powersgd_warm_start_off_at_load.py")
    assert "FAIL: ddp.checkpoint.dcp.resumed.powersgd.grad" in buggy and "uninterrupted" in buggy, buggy


def test_fp16_hook_over_synced_microbatches_is_held_to_every_syncs_rounding(tmp_path):
    """A 4-minute session's false positive (fuzzshard's own): with synced_first, each microbatch's sync rounds
    the running grad to float16, not only the step's total; the bound covers every such rounding."""
    r = run_cli("replay", Path(__file__).parent / "data" / "ddp_fp16_synced_microbatches.json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_lossy_hook_leaves_an_ignored_params_grad_uncompressed(tmp_path):
    """A 2.9.1 session's false positive (fuzzshard's own, on 2.13 too): the reference overflowed an ignored param's
    grad to inf as if fp16_compress_wrapper had compressed it; DDP never hands it to the hook."""
    r = run_cli("replay", Path(__file__).parent / "data" / "ddp_fp16_ignored_param_overflow.json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_join_averages_a_held_grad_with_the_joined_ranks_zeros(tmp_path):
    """The lead's case (leads/README.md, the decoder under Join): output.weight is in no param group, so
    zero_grad never clears it and its step-0 grad is held into step 1, where rank 1 has joined and shadows
    the all-reduce with zeros (Join's documented contribution), not with that held grad: torch gives
    (held + g_0) / 2, which the reference predicts (held x active / W, DDPTarget.held_grad_scale); before
    it, ddp.parity.grad of output.weight after step 1 (max abs 0.204)."""
    import json

    from fuzzshard.case import Case
    from fuzzshard.kernel.targets.ddp import DDPTarget

    known = Path(__file__).parent.parent / "fuzzshard" / "known" / "ddp.crash.Killed_by_SIGABRT.fwdbwd.all_reduce.json"
    case = Case.from_dict(json.loads(known.read_text())["case"])  # (its static_graph + find_unused: the known hang)
    case = dataclasses.replace(case, target_options={"ddp": {"gradient_as_bucket_view": True,
                                                             "broadcast_buffers": False}, "uneven": [2, 1]})
    case.check()
    assert "output.weight" not in {n for g in case.groups for n in g.params}
    assert [DDPTarget.held_grad_scale(case, k) for k in (0, 1)] == [1.0, 0.5]
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    replays_clean(path)
