"""Known findings' triggers and the plain-FQN view of wrapped models (no process groups)."""
import dataclasses
from pathlib import Path

import pytest
import torch

from fuzzshard.findings.record import is_known, known_signature, load_known, signature, triggered
from fuzzshard.kernel.model import named_params, submodule
from fuzzshard.findings.rootcause import Matcher

EVIDENCE = Path(__file__).parent / "data" / "evidence"  # finding files of a GPU session (torch 2.11, one H200)


def test_every_known_trigger_matches_its_own_case_and_the_tp_one_only_empty_shards():
    known = load_known()
    with_trigger = {sig: f for sig, f in known.items() if f.trigger}
    assert "fsdp2.error.other.RuntimeError.b4090951" in with_trigger
    for sig, f in with_trigger.items():
        assert triggered(f.case, {sig: f}) == sig  # a trigger that misses its own repro counts nothing
    sig = "fsdp2.error.other.RuntimeError.b4090951"
    case = known[sig].case  # Embedding(6, 1) colwise on 2 TP ranks: one holds an empty column shard
    layers = list(case.model.layers)
    layers[0] = dataclasses.replace(layers[0], d_out=2)
    layers[1] = dataclasses.replace(layers[1], d_in=2)
    wide = dataclasses.replace(case, model=dataclasses.replace(case.model, layers=tuple(layers)))
    assert triggered(wide, {sig: known[sig]}) is None  # two columns on two TP ranks: runs


def test_wrapped_models_keep_plain_fqns():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 3)), torch.nn.Linear(3, 1))
    inner = model[0][0]
    model[0] = checkpoint_wrapper(model[0])
    assert "0._checkpoint_wrapped_module.0.weight" in dict(model.named_parameters())
    assert list(named_params(model)) == ["0.0.weight", "0.0.bias", "1.weight", "1.bias"]
    assert submodule(model, "0.0") is inner
    assert submodule(model, "0") is model[0]  # the wrapper answers for what it wraps
    with pytest.raises(AttributeError):
        submodule(model, "0.5")


FAULTHANDLER_DUMP = '''Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  <no Python frame>

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 4100 in all_reduce
  File "/x/fuzzshard/kernel/targets/zero.py", line 170 in after_backward
  File "/x/fuzzshard/kernel/run.py", line 250 in _steps
'''


def test_a_crash_is_named_by_where_it_died_and_a_crash_elsewhere_is_new():
    """A known crash hides only itself: the signal alone (any SIGABRT in
    FSDP1) would count every new abort as known."""
    from fuzzshard.findings.record import is_known, signature
    from fuzzshard.pool.runner import _where

    assert _where(FAULTHANDLER_DUMP) == "zero.after_backward:all_reduce"  # innermost frame of ours, then torch's
    # a rank slow in a loop, looked at twice: the deepest frame in both is where it stays
    looped = FAULTHANDLER_DUMP.replace(
        '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 4100 in all_reduce\n',
        '  File "/x/site-packages/torch/distributed/tensor/_ops/x.py", line 9 in {}\n'
        '  File "/x/site-packages/torch/distributed/tensor/_redistribute.py", line 5 in plan\n')
    assert _where(looped.format("get_next_state"), looped.format("__instancecheck__")) == "zero.after_backward:plan"
    assert _where(FAULTHANDLER_DUMP, FAULTHANDLER_DUMP) == "zero.after_backward:all_reduce"  # blocked: as one look
    known = load_known()
    sig = "fsdp1.crash.Killed_by_SIGABRT.other.all_gather_single"
    f = known[sig]
    assert signature(f.case, f.verdict) == sig and is_known(sig, f.case, known)
    elsewhere = dataclasses.replace(f.verdict, extra={**f.verdict.extra, "where": {"1": "run._steps:all_reduce"},
                                                      "phase": {"1": "fwdbwd"}})
    other = signature(f.case, elsewhere)
    assert other == "fsdp1.crash.Killed_by_SIGABRT.fwdbwd.all_reduce" and not is_known(other, f.case, known)
    # no stack came back: the bare signal, not known
    nowhere = dataclasses.replace(f.verdict, extra={k: v for k, v in f.verdict.extra.items() if k != "where"})
    assert not is_known(signature(f.case, nowhere), f.case, known)


def test_a_hang_or_crash_signature_names_no_fuzzshard_module():
    """Where a rank hangs or dies is said as the kind of step it was in (the kernel's phase) and
    torch's function: renaming or moving fuzzshard's own code moves no signature (issue 29)."""
    from fuzzshard.findings.record import signature

    known = load_known()
    f = known["dtensor.hang.load.broadcast"]
    moved = dataclasses.replace(f.verdict, extra={**f.verdict.extra, "where": {"0": "somewhere_else.renamed:broadcast",
                                                                              "1": "x.y:redispatch"}})
    assert signature(f.case, moved) == signature(f.case, f.verdict) == "dtensor.hang.load.broadcast"
    for sig, g in known.items():
        if g.verdict.oracle in ("hang", "crash"):
            assert signature(g.case, g.verdict) == sig
            assert not any(part in sig.split(".") for part in ("state_io", "run", "zero.after_backward", "grads")), sig


def test_a_fused_step_divergence_says_whether_the_grad_it_read_was_contiguous():
    """The known fused-Adam bug (a non-contiguous grad read as contiguous) hides
    only itself: a fused divergence on grads laid out as the kernel expects is new,
    and it no longer matches that root cause."""
    from fuzzshard.findings.record import is_known, signature
    from fuzzshard.findings.rootcause import Matcher

    known = load_known()
    sig = "dtensor.parity.Adam.fused.param.noncontig_grad"
    f = known[sig]
    assert f.verdict.first.extra["grad"] == "non-contiguous" and signature(f.case, f.verdict) == sig
    matcher = Matcher(known)
    assert matcher.suspects(f.case, f.verdict) == ["cpu-fused-optim-noncontiguous-grad"]
    first = dataclasses.replace(f.verdict.first, extra={k: v for k, v in f.verdict.first.extra.items() if k != "grad"})
    contiguous = dataclasses.replace(f.verdict, first=first, mismatches=[first])
    other = signature(f.case, contiguous)
    assert other == "dtensor.parity.Adam.fused.param" and not is_known(other, f.case, known)
    assert matcher.suspects(f.case, contiguous) == []


def test_a_missing_sharding_strategy_is_named_by_its_op_and_known_by_its_family():
    """DTensor's 'no sharding strategy' names its op in the signature, but its
    address is the family: a gap in an op torch.optim calls (2.11's foreach
    lerp_ and index_put_, ops the root cause does not name) is a known hit of
    dtensor-missing-strategy-optimizer-ops with the op as its detail; a gap met
    in a model's own forward (an int8 matmul, say) is no hit: it stays new."""
    from fuzzshard.findings.record import load_finding
    from fuzzshard.findings.rootcause import address, caller, detail

    known = load_known()
    matcher = Matcher(known)
    for name, op in (("dtensor.error.step.NotImplementedError.af1d5b0d._foreach_lerp_", "aten._foreach_lerp_"),
                     ("tp.error.step.NotImplementedError.af1d5b0d.index_put_", "aten.index_put_")):
        f = load_finding(EVIDENCE / f"{name}.json")
        assert signature(f.case, f.verdict) == name and not is_known(name, f.case, known)
        hit = matcher.known_hit(f.case, f.verdict)
        assert (hit.root_cause, hit.detail, hit.named) == ("dtensor-missing-strategy-optimizer-ops", op, False)
        assert hit.text == f"{op}, an op the root cause does not name" and caller(f.case, f.verdict) == "torch/optim"
    f = known["dtensor.error.step.NotImplementedError.af1d5b0d._foreach_copy_"]
    assert matcher.known_hit(f.case, f.verdict).named and detail(f.case, f.verdict) == "aten._foreach_copy_"
    sdpa = known["dtensor.error.fwdbwd.NotImplementedError.af1d5b0d._scaled_dot_product_flash_attention_for_cpu"]
    message = sdpa.verdict.error.message.replace("_scaled_dot_product_flash_attention_for_cpu", "_weight_int8pack_mm")
    other = dataclasses.replace(sdpa.verdict, error=dataclasses.replace(sdpa.verdict.error, message=message))
    new = signature(sdpa.case, other)
    assert new == "dtensor.error.fwdbwd.NotImplementedError.af1d5b0d._weight_int8pack_mm"
    assert address(sdpa.case, other) == address(f.case, f.verdict)  # one family
    assert not is_known(new, sdpa.case, known) and matcher.known_hit(sdpa.case, other) is None
    assert matcher.suspects(sdpa.case, other) == ["dtensor-missing-strategy-optimizer-ops", "dtensor-sdpa-cpu-no-strategy"]


def test_a_known_root_cause_met_in_another_phase_or_on_another_target_is_a_known_hit():
    """Adafactor's in-place square on a _NormPartial met in a load's init step
    (2.11, H200) is that known root cause, not a new finding; so is its fsdp2
    face (61658fa9, met on the CPU) and fsdp2's foreach ASGD over two meshes in
    a step (56cd5e7e), whose address names no torch code: its message decides
    between the two root causes there. A wrapper's own bug is no other target's."""
    from fuzzshard.findings.record import load_finding

    known = load_known()
    matcher = Matcher(known)
    f = load_finding(EVIDENCE / "dtensor.error.load.RuntimeError.89967c22.json")
    assert matcher.label(f.case, f.verdict).startswith("probably root cause adafactor-inplace-square-on-norm-partial")
    assert matcher.known_hit(f.case, f.verdict).root_cause == "adafactor-inplace-square-on-norm-partial"
    fsdp2 = known["dtensor.error.load.RuntimeError.61658fa9"]
    as_fsdp2 = dataclasses.replace(fsdp2.case, target="fsdp2", target_options={})
    assert not is_known(signature(as_fsdp2, fsdp2.verdict), as_fsdp2, known)
    assert matcher.known_hit(as_fsdp2, fsdp2.verdict).root_cause == "adafactor-inplace-square-on-norm-partial"
    asgd = known["fsdp2.error.load.RuntimeError.56cd5e7e"]
    step = dataclasses.replace(asgd.verdict, error=dataclasses.replace(
        asgd.verdict.error, phase="step 0: optimizer.step", extra={**asgd.verdict.error.extra, "stage": "step"}))
    assert signature(asgd.case, step) == "fsdp2.error.step.RuntimeError.56cd5e7e"
    assert len(matcher.by_address["raises RuntimeError in fuzzshard or the test (no torch frame)"]) == 2
    assert matcher.suspects(asgd.case, step) == ["dtensor-foreach-scalar-tensor-single-compute-mesh"]
    hit = matcher.known_hit(asgd.case, step)
    assert hit.root_cause == "dtensor-foreach-scalar-tensor-single-compute-mesh"
    assert hit.text == "raises RuntimeError in fuzzshard or the test (no torch frame), with the same message"
    # the same address ("no torch frame") with another message is no hit of either
    odd = dataclasses.replace(step, error=dataclasses.replace(step.error, message="something else entirely"))
    assert matcher.known_hit(asgd.case, odd) is None
    # a divergence's address says where it showed, not what made it: never a known hit by address
    f1 = known["fsdp1.checkpoint.dcp.loaded.state.step"]
    assert matcher.suspects(f1.case, f1.verdict) and matcher.known_hit(f1.case, f1.verdict) is None
    # an FSDP1 FlatParameter error met by a dtensor case: probably that, but no hit (a wrapper's own bug)
    flat = next(f for f in known.values() if f.root_cause == "fsdp1-shared-0d-step" and f.verdict.oracle == "error_parity")
    as_dtensor = dataclasses.replace(flat.case, target="dtensor", target_options={})
    assert matcher.suspects(as_dtensor, flat.verdict) == ["fsdp1-shared-0d-step"]
    assert matcher.known_hit(flat.case, flat.verdict) and matcher.known_hit(as_dtensor, flat.verdict) is None


def test_a_compiled_case_is_named_as_compiled_and_meets_known_eager_errors_only():
    """--compile: a compiled run's divergence is compile's own (its signature and
    address say so); an error it raises the way a known eager one does is that one."""
    known = load_known()
    eager = known["fsdp2.error.step.RuntimeError.61658fa9"]
    case = dataclasses.replace(eager.case, target_options={**eager.case.target_options, "compile": "after"})
    sig = signature(case, eager.verdict)
    assert sig == "fsdp2.compiled.error.step.RuntimeError.61658fa9"
    assert known_signature(sig, case, known) == "fsdp2.error.step.RuntimeError.61658fa9"
    ckpt = known["fsdp2.compiled_ckpt.parity.grad"]
    assert signature(ckpt.case, ckpt.verdict) == "fsdp2.compiled_ckpt.parity.grad" and is_known(
        "fsdp2.compiled_ckpt.parity.grad", ckpt.case, known)
    plain = dataclasses.replace(ckpt.case, target_options={k: v for k, v in ckpt.case.target_options.items()
                                                            if k not in ("compile", "compile_step")})
    assert signature(plain, ckpt.verdict) == "fsdp2.parity.grad"  # eager: not compile's bug, not known as it
    assert not is_known("fsdp2.parity.grad", plain, known)
    assert Matcher(known).suspects(ckpt.case, ckpt.verdict) == ["compile-composable-checkpoint-wrong-grads"]
    assert "compile-composable-checkpoint-wrong-grads" not in Matcher(known).suspects(plain, ckpt.verdict)


def test_a_wrapper_own_root_cause_is_no_suspect_for_another_target():
    """loaded.state.step is the address of DSD's frozen-param bug (Adagrad's fresh
    step 0) and of FSDP1's shared 0-d step: a dtensor finding there is only the first."""
    from fuzzshard.findings.rootcause import Matcher

    known = load_known()
    f = known.pop("dtensor.checkpoint.full.loaded.state.step")
    matcher = Matcher(known)
    assert matcher.suspects(f.case, f.verdict) == ["dsd-frozen-param-optim-state-dropped"]
    fsdp1 = known["fsdp1.checkpoint.dcp.loaded.state.step"]
    assert matcher.suspects(fsdp1.case, fsdp1.verdict) == ["dsd-frozen-param-optim-state-dropped",
                                                           "fsdp1-shared-0d-step"]


def test_a_known_finding_with_a_generic_signature_is_known_only_where_its_conditions_hold():
    """pp.parity.loss is known for unequal microbatches only (only_when): the same signature on equal ones is new."""
    import dataclasses

    from fuzzshard.findings.record import known_signature, load_known

    known = load_known()
    f = known["pp.parity.loss"]
    assert f.only_when and known_signature("pp.parity.loss", f.case, known) == "pp.parity.loss"
    even = dataclasses.replace(f.case, target_options={**f.case.target_options, "n_microbatches": 2})
    assert even.batch % 2 == 0 and known_signature("pp.parity.loss", even, known) is None


def test_a_pp_error_fsdp2_or_dtensor_raises_with_the_same_message_is_their_known_bug_but_pp_parity_is_its_own():
    """A [pp, dp] stage is FSDP2 over dp: Rprop's in-place index_put_ on a Shard(0) param raises there as under
    fsdp2 (a timed pp session called it new, 5 cases in 200); pp's parity signatures are not mapped (a pp.parity.grad
    must never hide behind fsdp2's known one)."""
    from fuzzshard.findings.record import known_signature, load_known

    known = load_known()
    case = known["pp.parity.loss"].case
    assert known_signature("pp.error.step.RuntimeError.61658fa9", case, known) == "fsdp2.error.step.RuntimeError.61658fa9"
    assert "dtensor.parity.forward.Conv1d" in known and "fsdp2.parity.grad" in known
    assert known_signature("pp.parity.forward.Conv1d", case, known) is None
    assert not (known_signature("pp.parity.grad", case, known) or "pp.").startswith("fsdp2.")  # its own, or none


def test_an_async_saves_face_of_a_known_blocking_save_bug_is_known():
    """A load after dcp.async_save that loses what a blocking save's load loses is that known DSD bug."""
    import dataclasses

    from fuzzshard.findings.record import known_signature, load_known

    known = load_known()
    f = known["fsdp2.checkpoint.dcp.loaded.group.empty_group"]
    c = dataclasses.replace(f.case, checkpoint=dataclasses.replace(f.case.checkpoint, async_save="thread"))
    assert known_signature("fsdp2.checkpoint.dcp_async.loaded.group.empty_group", c, known) == f.signature
    assert known_signature("fsdp2.checkpoint.dcp_async.loaded.param", c, known) is None


def test_a_zero_group_lacking_any_hyperparameter_is_the_known_add_param_group_bug():
    """ZeRO's add_param_group leaves the group without the inner optimizer's defaults until a step that is not
    skipped: which key the parity oracle names first is only the optimizer's first in sorted order (Adam's amsgrad,
    SGD's dampening, Adagrad's differentiable), so each is that known root cause; on another target, or a key
    with another value (not missing), it is not."""
    from fuzzshard.findings.rootcause import LACKS_HPARAM, address

    known = load_known()
    matcher = Matcher(known)
    f = known["zero.parity.Adam.forloop.group.amsgrad"]
    assert address(f.case, f.verdict) == LACKS_HPARAM

    def face(name, impl, key, detail, target="zero"):
        first = dataclasses.replace(f.verdict.first, quantity=f"param_groups.{key}", detail=detail)
        kwargs = {"lr": 0.01, "foreach": impl == "foreach", **({"fused": True} if impl == "fused" else {})}
        case = dataclasses.replace(f.case, target=target, optim=dataclasses.replace(f.case.optim, name=name, kwargs=kwargs))
        return case, dataclasses.replace(f.verdict, first=first, mismatches=[first])

    for name, impl, key, detail in [("Adagrad", "foreach", "differentiable", "None vs reference False"),
                                    ("SGD", "forloop", "dampening", "None vs reference 0"),
                                    ("RMSprop", "fused", "alpha", "None vs reference 0.99")]:
        case, verdict = face(name, impl, key, detail)
        assert signature(case, verdict) == f"zero.parity.{name}.{impl}.group.{key}"
        assert not is_known(signature(case, verdict), case, known)
        assert matcher.known_hit(case, verdict).root_cause == "zero-add-param-group-lacks-defaults"
    assert matcher.known_hit(*face("Adagrad", "foreach", "differentiable", "None vs reference False", "fsdp2")) is None
    assert matcher.known_hit(*face("Adam", "forloop", "lr", "0.1 vs reference 0.01")) is None
    assert matcher.known_hit(*face("Adam", "forloop", "foreach", "None vs reference None")) is None


def test_a_sequentiallr_tensor_lr_checkpoint_face_is_known_only_for_that_scheduler_and_lr():
    """SequentialLR's _last_lr aliases its child's list: over a tensor lr, DCP's in-place load reports a stale lr.
    The signature is any scheduler's (only_when): a float lr or another scheduler there is new; tp meets it as
    dtensor's, and an async save's load as the blocking one's."""
    known = load_known()
    sig = "fsdp2.checkpoint.dcp.loaded.lr_scheduler._last_lr"
    f = known[sig]
    assert f.root_cause == "sequentiallr-last-lr-aliased-dcp-load"
    assert known_signature(sig, f.case, known) == sig
    one_d = dataclasses.replace(f.case, optim=dataclasses.replace(f.case.optim, tensor_lr="1d"))
    assert known_signature(sig, one_d, known) == sig
    floats = dataclasses.replace(f.case, optim=dataclasses.replace(f.case.optim, tensor_lr=""))
    assert known_signature(sig, floats, known) is None
    step_lr = dataclasses.replace(f.case, lr_scheduler=f.case.lr_scheduler.children[1])
    assert known_signature(sig, step_lr, known) is None
    d = known["dtensor.checkpoint.dcp.loaded.lr_scheduler._last_lr"]
    tp = dataclasses.replace(d.case, target="tp", target_options={})
    assert known_signature("tp.checkpoint.dcp.loaded.lr_scheduler._last_lr", tp, known) is not None
    async_ = dataclasses.replace(f.case, checkpoint=dataclasses.replace(f.case.checkpoint, async_save="pinned"))
    assert known_signature("fsdp2.checkpoint.dcp_async.loaded.lr_scheduler._last_lr", async_, known) == sig


def test_a_known_finding_known_only_under_its_conditions_makes_no_suspect_elsewhere():
    """pp.parity.grad is known only for a split backward without a weight path (only_when): a zero case's grad
    divergence has its address ("grad") and was labelled "probably" that pipelining bug; it is no suspect now."""
    known = load_known()
    matcher = Matcher(known)
    pp = known["pp.parity.grad"]
    assert matcher.suspects(pp.case, pp.verdict) == ["pp-zero-bubble-fsdp-reshard-after-forward"]
    zero = known["zero.parity.Adam.forloop.group.amsgrad"].case
    assert matcher.suspects(zero, pp.verdict) == [] and matcher.label(zero, pp.verdict) == ""


def test_a_loaded_scheduler_value_is_named_without_its_param_groups_index():
    """Which param group's lr shows first is incidental: a 1-d tensor lr's _last_lr (lists of one) and a float's
    name one quantity, the entry said in the detail; a child scheduler's place (a dict's) still names it."""
    from fuzzshard.kernel.checkpoint import check_loaded_loop

    case = load_known()["fsdp2.checkpoint.dcp.loaded.lr_scheduler._last_lr"].case
    saved = {"lr_scheduler": {"_last_lr": [[0.5], [0.25]], "_schedulers": [{"last_epoch": 2}]}}
    loaded = {"lr_scheduler": {"_last_lr": [[0.5], [0.5]], "_schedulers": [{"last_epoch": 1}]}}
    got = check_loaded_loop(case, saved, loaded)
    assert [(m["quantity"], m["detail"]) for m in got] == [
        ("loaded.lr_scheduler._last_lr", "0.5 loaded, 0.25 saved at [1][0]"),
        ("loaded.lr_scheduler._schedulers.0.last_epoch", "1 loaded, 2 saved")]


def test_fsdp1_scatter_placeholder_replica_faces_are_known_for_a_1d_tensor_lr_scattered_only():
    """The replica oracle's face of FSDP1's rank-0-only tensor lr placeholder (loaded.group.lr / initial_lr) is that
    known bug where its conditions hold (a 1-d tensor lr, a scatter load), a new finding elsewhere."""
    known = load_known()
    for sig in ("fsdp1.replica.loaded.group.lr", "fsdp1.replica.loaded.group.initial_lr"):
        f = known[sig]
        assert f.root_cause == "fsdp1-rank0-only-optim-load-tensor-lr-placeholder"
        assert known_signature(sig, f.case, known) == sig
        floats = dataclasses.replace(f.case, optim=dataclasses.replace(f.case.optim, tensor_lr=""))
        assert known_signature(sig, floats, known) is None
        ck = f.case.checkpoint
        shard = dataclasses.replace(f.case, checkpoint=dataclasses.replace(
            ck, target_options={**ck.target_options, "legacy_load": "shard"}))
        assert known_signature(sig, shard, known) is None


def test_a_crash_at_a_collective_is_the_amp_found_inf_bug_only_where_a_partial_overflow_split_the_ranks():
    """DTensor's found_inf handler reads the first grad's placements only: an inf in one rank's shard makes that
    rank skip alone and the next collective aborts. A crash there is any bug's face, so it is this known root
    cause only under a partial overflow (only_when), a new finding otherwise."""
    known = load_known()
    for sig in ("dtensor.crash.Killed_by_SIGABRT.other.all_gather", "dtensor.crash.Killed_by_SIGABRT.other.all_gather_single",
                "tp.parity.loop.found_inf"):  # (a fused optimizer takes found_inf: the ranks diverge, nothing aborts)
        f = known[sig]
        assert f.root_cause == "dtensor-amp-found-inf-first-grad-placements"
        assert f.case.scaler.overflow_at is not None and known_signature(sig, f.case, known) == sig
        whole = dataclasses.replace(f.case, scaler=dataclasses.replace(f.case.scaler, overflow_at=None))
        assert known_signature(sig, whole, known) is None


def test_two_root_causes_under_one_signature_are_told_apart_by_their_conditions():
    # an in-place op on a Partial input is the message template of rms_norm's eps and of CPU dropout's bernoulli_;
    # pp.parity.grad is zero-bubble's lost weight grads and a tie across two stages of one rank with scale_grads:
    # each known file's case is known as itself (its file's name, so its own root cause), the first that holds wins
    from fuzzshard.findings.record import under

    known = load_known()
    pairs = {"dtensor.error.fwdbwd.RuntimeError.61658fa9": "dropout", "pp.parity.grad": "tie-stages-scale-grads"}
    for sig, suffix in pairs.items():
        assert under(sig, known)[0] == sig and f"{sig}.{suffix}" in under(sig, known)  # (pp.parity.grad: 3 causes)
        assert known[f"{sig}.{suffix}"].signature == sig and known[sig].root_cause != known[f"{sig}.{suffix}"].root_cause
        for name in under(sig, known):
            assert known_signature(sig, known[name].case, known) == name
    drop = known["dtensor.error.fwdbwd.RuntimeError.61658fa9.dropout"]
    assert drop.devices == ["cpu"]  # CUDA's dropout is out of place: a CUDA case there would be another bug
    assert known_signature(drop.signature, dataclasses.replace(drop.case, device="cuda"), known) is None
    tie = known["pp.parity.grad.tie-stages-scale-grads"].case
    unscaled = dataclasses.replace(tie, target_options={**tie.target_options, "scale_grads": False})
    assert known_signature("pp.parity.grad", unscaled, known) is None  # neither condition holds: new
    # a session counts a hit under the name, so by the right root cause (cli/fuzz.py, findings/life.py)
    assert Matcher(known).causes[drop.root_cause].signatures == [f"{drop.signature}.dropout"]
