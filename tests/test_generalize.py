"""One finding per bug (generalize.py) and errors that are fuzzshard's own
(judge.internal_error): pure functions over cases and verdicts, no pool; and
one real session, where a user's optimizer with one planted bug fuzzed on two
targets gives one finding."""
import json
from pathlib import Path
from types import SimpleNamespace

from cases import simple_case
from conftest import run_cli

from fuzzshard.findings.generalize import Face, carry, faces_of, generalize, kin, same_way, table_text, variants
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


def test_a_case_is_carried_to_the_kin_targets_that_place_its_params_alike():
    """dtensor, tp and fsdp2 share their known bugs (known_as): a case runs on
    another of them where that one places every param as the case did (fsdp2:
    Shard(0) on the last mesh dim; tp without a plan: replicated), a
    data-parallel target's batch made a multiple of its ranks; elsewhere not."""
    import dataclasses

    assert kin("dtensor") == ("fsdp2", "tp") and kin("fsdp2") == ("dtensor", "tp") and kin("zero") == ()
    names = ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    case = simple_case(2, optim="Adam", placements={n: ["S0"] for n in names})  # batch 3
    fsdp2 = carry(case, "fsdp2")
    assert fsdp2.target == "fsdp2" and fsdp2.target_options == {} and fsdp2.batch == 4
    assert carry(case, "tp") is None  # a TP plan is no placement of ours
    assert carry(simple_case(2, optim="Adam"), "fsdp2") is None  # S1 on layers.2.weight: fsdp2 shards dim 0
    back = carry(fsdp2, "dtensor")
    assert back.target_options == {"placements": {n: ["S0"] for n in names}} and back.batch == 4
    replicated = dataclasses.replace(case, target_options={})
    assert carry(replicated, "tp").target_options == {} and carry(replicated, "fsdp2") is None
    assert ("target", "dtensor") in {(d, v) for d, v, _ in variants(fsdp2, ["Adam"], kin("fsdp2"))}
    assert "target" not in {d for d, _, _ in variants(fsdp2, ["Adam"])}  # a caller that runs no other target


def test_a_variant_on_another_target_that_fails_the_same_way_is_a_face_of_the_bug():
    case = simple_case(2, optim="SGD", placements={n: ["S0"] for n in ("layers.0.weight", "layers.0.bias",
                                                                          "layers.2.weight", "layers.2.bias")})
    bug = _step_verdict(["layers.2.weight"])

    def judge_many(cases):  # the bug is in SGD's step on any target
        return [SimpleNamespace(verdict=bug if c.optim.name == "SGD" else Verdict.from_dict(passing()),
                                label=f"{c.target}.parity.SGD.{c.optim.implementation}.param" if c.optim.name == "SGD"
                                else "pass") for c in cases]

    table, sigs = generalize(judge_many, case, bug, ["SGD", "Adam"], kin("dtensor"))
    assert "fsdp2.parity.SGD.forloop.param" in sigs and "target: fails with fsdp2" in table_text(table)


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


ORTHO = Path(__file__).parent.parent / "examples" / "ortho_momentum.py"


def test_a_users_optimizer_bug_met_on_dtensor_and_fsdp2_is_one_finding(tmp_path, monkeypatch):
    """examples/ortho_momentum.py with its planted bug (each rank orthogonalizes
    its local shard) on dtensor and fsdp2: the session met it on both (two
    findings before targets were a dimension); one is the other's case carried
    to the other target, failing the same way: one finding, its target row."""
    monkeypatch.setenv("ORTHO_MOMENTUM_BUG", "local_shard")
    out = tmp_path / "out"
    r = run_cli("fuzz", "--plugin", ORTHO, "--optimizers", "OrthoMomentum", "--target", "dtensor,fsdp2",
                "--world-sizes", "1,2", "--checkpoints", "none", "--seed", 3, "--max-examples", 40, "--out", out)
    found = sorted(out.glob("*.json"))
    assert r.returncode == 1 and len(found) == 1, r.stderr[-3000:]
    finding = json.loads(found[0].read_text())
    sig, target = finding["signature"], finding["case"]["target"]
    other = {"dtensor": "fsdp2", "fsdp2": "dtensor"}[target]
    assert sig == f"{target}.parity.OrthoMomentum.forloop.param" and finding["stage"] == "confirmed"
    assert finding["verdict"]["first"]["fqn"] == "layers.0.weight" and finding["verdict"]["first"]["step"] == 0
    assert f"{other}.parity.OrthoMomentum.forloop.param" in finding["faces"]
    rows = [Face(**row) for row in finding["generalization"] if row["dimension"] == "target"]
    assert f"target: fails with {other}" in table_text(rows)
    assert f"FINDING {sig}\n" in r.stderr and f"        target: fails with {other}" in r.stderr
    assert "1 new finding(s), one per bug, under 2 signature(s)" in r.stderr
