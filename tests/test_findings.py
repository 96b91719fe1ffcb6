"""Known findings' triggers and the plain-FQN view of wrapped models (no process groups)."""
import dataclasses

import pytest
import torch

from fuzzshard.findings.record import is_known, known_signature, load_known, signature, triggered
from fuzzshard.kernel.model import named_params, submodule
from fuzzshard.findings.rootcause import Matcher


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


def test_a_missing_sharding_strategy_is_named_by_its_op():
    """DTensor's 'no sharding strategy' is a gap of one op: a new op's gap (an int8
    matmul, say) is a new finding, not a hit of the known optimizer-ops one."""
    from fuzzshard.findings.record import is_known, signature
    from fuzzshard.findings.rootcause import Matcher

    known = load_known()
    sig = "dtensor.error.step.NotImplementedError.af1d5b0d._foreach_copy_"
    f = known[sig]
    assert signature(f.case, f.verdict) == sig
    message = f.verdict.error.message.replace("_foreach_copy_", "_weight_int8pack_mm")
    other = dataclasses.replace(f.verdict, error=dataclasses.replace(f.verdict.error, message=message))
    new = signature(f.case, other)
    assert new == "dtensor.error.step.NotImplementedError.af1d5b0d._weight_int8pack_mm"
    assert not is_known(new, f.case, known) and Matcher(known).suspects(f.case, other) == []


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
