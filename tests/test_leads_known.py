"""Crash leads recorded as faces of known root causes (leads/README.md), each known only under the
conditions its root cause needs, so the same generic crash signature elsewhere still reports as new."""
import dataclasses
import json

from fuzzshard.case import Case
from fuzzshard.findings.record import KNOWN_DIR, facts, is_known, load_known


def _case(name: str) -> Case:
    return Case.from_dict(json.loads((KNOWN_DIR / f"{name}.json").read_text())["case"])


def test_a_dtensor_abort_is_known_only_with_a_sharded_conv_param():
    """dtensor-conv-handlers-skip-redistribution: a Shard(2) Conv1d weight's malformed output aborts gloo at its
    next collective; the dead rank's frame varies, so two faces are recorded, both only under conv_sharded."""
    known = load_known()
    case = _case("dtensor.crash.Killed_by_SIGABRT.fwdbwd")
    assert facts(case)["conv_sharded"]
    placements = {**case.target_options["placements"], "layers.1.conv.weight": ["R"]}
    replicated = dataclasses.replace(case, target_options={**case.target_options, "placements": placements})
    assert not facts(replicated)["conv_sharded"]
    for sig in ("dtensor.crash.Killed_by_SIGABRT.fwdbwd", "dtensor.crash.Killed_by_SIGABRT.fwdbwd.redispatch"):
        assert known[sig].root_cause == "dtensor-conv-handlers-skip-redistribution"
        assert is_known(sig, case, known) and not is_known(sig, replicated, known)
    # its raising face (--models moe on dtensor): the MoE's routing on the wrongly sized full copy of its input
    sig = "dtensor.error.fwdbwd.RuntimeError.13745e5e"
    case = _case(sig)
    placements = {**case.target_options["placements"], "layers.0.conv.weight": ["R"]}
    replicated = dataclasses.replace(case, target_options={**case.target_options, "placements": placements})
    assert known[sig].root_cause == "dtensor-conv-handlers-skip-redistribution"
    assert is_known(sig, case, known) and not is_known(sig, replicated, known)


def test_a_ddp_abort_under_join_is_known_only_with_static_graph_and_find_unused():
    """ddp-join-static-graph-unused-params-hang's crash face: the joined rank's extra all-reduce of the used map."""
    known, sig = load_known(), "ddp.crash.Killed_by_SIGABRT.fwdbwd.all_reduce"
    case = _case(sig)
    assert known[sig].root_cause == "ddp-join-static-graph-unused-params-hang" and is_known(sig, case, known)
    o = case.target_options
    for change in ({"static_graph": False}, {"find_unused_parameters": False}):
        other = dataclasses.replace(case, target_options={**o, "ddp": {**o["ddp"], **change}})
        assert not is_known(sig, other, known)
    even = dataclasses.replace(case, target_options={k: v for k, v in o.items() if k != "uneven"})
    assert not is_known(sig, even, known)


def test_the_lowbit_full_state_dict_faces_are_known_only_with_a_lowbit_optimizer_and_a_full_checkpoint():
    """torchao-lowbit-full-state-dict-mixed's faces met by the --ao hunt (the abort met at funcol's wait, in
    torchao's dispatch, or in fuzzshard's error record after the unpad's slice raised; that slice raising first;
    the mismatched all-gathers hanging), and torchao-lowbit-full-state-dict-load's (a full state dict that saved
    cannot be loaded: OptimState implements no c10d.broadcast_): known only for a low-bit optimizer with a full or
    broadcast checkpoint, so the same generic signature elsewhere still reports as new."""
    known = load_known()
    causes = {"fsdp2.crash.Killed_by_SIGABRT.save.unpad_tensor": "torchao-lowbit-full-state-dict-mixed",
              "fsdp2.crash.Killed_by_SIGABRT.save.redispatch": "torchao-lowbit-full-state-dict-mixed",
              "fsdp2.crash.Killed_by_SIGABRT.save": "torchao-lowbit-full-state-dict-mixed",
              "fsdp2.error.save.ValueError.7b0481a1": "torchao-lowbit-full-state-dict-mixed",
              "fsdp2.hang.save.redispatch": "torchao-lowbit-full-state-dict-mixed",
              "fsdp2.error.load.NotImplementedError.314ed209": "torchao-lowbit-full-state-dict-load"}
    for sig, cause in causes.items():
        case = _case(sig)
        assert known[sig].root_cause == cause, sig
        plain = dataclasses.replace(case, optim=dataclasses.replace(case.optim, name="AdamW"))
        dcp = dataclasses.replace(case, checkpoint=dataclasses.replace(case.checkpoint, kind="dcp"))
        assert is_known(sig, case, known) and not is_known(sig, plain, known) and not is_known(sig, dcp, known), sig


def test_the_lowbit_async_wrapper_load_face_is_known_only_with_a_lowbit_optimizer_and_a_full_checkpoint():
    """torchao-lowbit-full-state-dict-async-wrapper (the ao48 hunt's lead): a low-bit optimizer's full state dict
    saved over 4 ranks keeps funcol's AsyncCollectiveTensors inside its OptimState, which the weights-only load
    refuses. Known only for a low-bit optimizer with a full or broadcast checkpoint, so an UnpicklingError at the
    load elsewhere still reports as new."""
    known, sig = load_known(), "fsdp2.error.load.UnpicklingError.0c283fdf"
    case = _case(sig)
    assert known[sig].root_cause == "torchao-lowbit-full-state-dict-async-wrapper"
    assert "AsyncCollectiveTensor" in known[sig].verdict.error_record.traceback
    plain = dataclasses.replace(case, optim=dataclasses.replace(case.optim, name="AdamW"))
    dcp = dataclasses.replace(case, checkpoint=dataclasses.replace(case.checkpoint, kind="dcp"))
    assert is_known(sig, case, known) and not is_known(sig, plain, known) and not is_known(sig, dcp, known)
