"""One finding per bug (generalize.py) and errors that are fuzzshard's own
(judge.internal_error): pure functions over cases and verdicts, no pool."""
from types import SimpleNamespace

from cases import simple_case

from fuzzshard.findings.generalize import Face, faces_of, generalize, same_way, table_text, variants
from fuzzshard.findings.judge import internal_error
from fuzzshard.verdict import Verdict, finding, passing


def _step_verdict(fqns, step=0, quantity="param"):
    return Verdict.from_dict(finding("parity", [{"quantity": quantity, "fqn": f, "step": step, "detail": "differs"}
                                                for f in fqns]))


def test_variants_change_one_dimension_each_and_stay_well_formed():
    case = simple_case(optim="Adam", lr=0.01, foreach=True)
    found = variants(case, ["Adam", "SGD", "Adagrad"])
    dims = {(d, v) for d, v, _ in found}
    assert ("implementation", "forloop") in dims and ("implementation", "fused") in dims
    assert {("optimizer", "SGD"), ("optimizer", "Adagrad"), ("dtype", "float64")} <= dims
    for dim, value, v in found:
        v.check_world()
        assert v.model == case.model and v.world_size == case.world_size
        if dim == "optimizer":  # what the two share is kept (lr, weight_decay), what the new one lacks dropped
            assert v.optim.name == value and v.optim.kwargs["weight_decay"] == 0.1
            assert v.optim.implementation == "foreach"
            assert all(set(g.overrides) <= {"lr"} for g in v.groups)
        if dim == "implementation":
            assert v.optim.implementation == value and v.optim.name == "Adam"


def test_the_same_failure_on_the_same_params_is_one_bug_and_other_params_another():
    a = _step_verdict(["layers.2.weight", "layers.2.bias"])
    assert same_way(a, _step_verdict(["layers.2.weight", "layers.2.bias"], quantity="state.exp_avg"))
    assert not same_way(a, _step_verdict(["layers.0.weight"]))  # other params: another bug
    assert not same_way(a, _step_verdict(["layers.2.weight", "layers.2.bias"], step=1))  # another step
    assert not same_way(a, _step_verdict(["layers.2.weight", "layers.2.bias"], quantity="grad"))  # a grad bug
    assert not same_way(a, Verdict.from_dict(passing()))


def test_faces_are_the_quantities_of_the_same_phase_only():
    case = simple_case(optim="Adam", lr=0.01, foreach=True)
    v = Verdict.from_dict(finding("parity", [{"quantity": "param", "fqn": "layers.0.weight", "step": 0, "detail": ""},
                                             {"quantity": "state.exp_avg", "fqn": "layers.0.weight", "step": 0, "detail": ""},
                                             {"quantity": "param", "fqn": "layers.0.weight", "step": 1, "detail": ""}]))
    assert faces_of(case, v) == {"dtensor.parity.Adam.foreach.param", "dtensor.parity.Adam.foreach.state.exp_avg"}
    grad = Verdict.from_dict(finding("parity", [{"quantity": "grad", "fqn": "layers.0.weight", "step": 0, "detail": ""},
                                                {"quantity": "param", "fqn": "layers.0.weight", "step": 0, "detail": ""}]))
    assert faces_of(case, grad) == {"dtensor.parity.grad"}  # the params a wrong grad moved are no face of it


def test_generalize_folds_the_variants_that_fail_the_same_way_and_tabulates_the_rest():
    case = simple_case(optim="Adam", lr=0.01, foreach=True)
    bug = _step_verdict(["layers.2.weight"])

    def judge_many(cases):  # the bug shows in every optimizer but SGD; Adagrad fails on other params
        out = []
        for c in cases:
            v = (Verdict.from_dict(passing()) if c.optim.name == "SGD" else _step_verdict(["layers.0.weight"]) if c.optim.name == "Adagrad"
                 else bug)
            sig = f"dtensor.parity.{c.optim.name}.{c.optim.implementation}.param" if v.is_finding else None
            out.append(SimpleNamespace(verdict=v, label=sig or "pass"))
        return out

    table, sigs = generalize(judge_many, case, bug, ["Adam", "SGD", "Adagrad", "AdamW"])
    assert "dtensor.parity.AdamW.foreach.param" in sigs and "dtensor.parity.Adam.fused.param" in sigs
    assert not any("SGD" in s or "Adagrad" in s for s in sigs)  # a pass, and another bug
    rows = {(f.dimension, f.value): f.outcome for f in table}
    assert rows[("optimizer", "SGD")] == "passes" and rows[("optimizer", "Adagrad")] == "fails otherwise"
    text = table_text(table)
    assert "optimizer: fails with AdamW; passes with SGD; fails otherwise with Adagrad (dtensor.parity.Adagrad" in text
    assert Face(**table[0].to_dict()) == table[0]


def _error(type_, frames):
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "{f}", line 7, in fn\n    x\n' for f in frames)
    return Verdict.from_dict(finding("error_parity", error={"type": type_, "message": "m", "phase": "forward",
                                                            "traceback": tb}))


def test_an_error_in_fuzzshards_own_code_is_internal_and_torchs_is_a_finding():
    import fuzzshard
    import torch

    ours = fuzzshard.__file__.replace("__init__.py", "kernel/targets/fsdp2.py")
    theirs = torch.__file__.replace("__init__.py", "distributed/tensor/_api.py")
    why = internal_error(_error("AttributeError", [theirs, ours]))
    assert why and "fuzzshard/kernel/targets/fsdp2.py:7" in why
    assert internal_error(_error("NameError", [ours])) is not None
    assert internal_error(_error("AttributeError", [ours, theirs])) is None  # raised inside torch
    # torch's C++ raises RuntimeError with fuzzshard's frame innermost; the kernel's checks are AssertionErrors
    assert internal_error(_error("RuntimeError", [theirs, ours])) is None
    assert internal_error(_error("ReplicasDiverged", [ours])) is None
    assert internal_error(_step_verdict(["w"])) is None
