"""One finding per bug (generalize.py; simulated.py's onsets across modules) and errors that are
fuzzshard's own (judge.internal_error): pure functions over cases and verdicts, no pool; and two real
sessions, one planted bug each, that give one finding: a user's optimizer fuzzed on two targets, and a
replica drift met as the checkpoint face it leaves too."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

from cases import simple_case
from conftest import run_cli

from fuzzshard.findings.generalize import (UP_TO_THE_SAVE, Face, carry, earlier, faces_of, generalize, kin, same_way,
                                          table_text, variants)
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

    # (ep is FSDP2 with expert parallelism: kin by its layout; a case it cannot take, e.g. one without an MoE layer,
    # is not carried there: carry() asks Case.check)
    assert kin("dtensor") == ("ep", "fsdp2", "tp") and kin("fsdp2") == ("dtensor", "ep", "tp") and kin("zero") == ()
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


# -- one bug across oracles: a checkpoint's face of a replica that drifted before the save -----------------
REPLICATED = ("layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias")


def _ckpt_case(after=0):
    import dataclasses

    from fuzzshard.case import Checkpoint

    return dataclasses.replace(simple_case(2, optim="SGD", foreach=False), target_options={},
                               checkpoint=Checkpoint(after, "dcp", 2, (2,)))


def _mismatches(quantity, fqns, step=0):
    return [{"quantity": quantity, "fqn": f, "step": step, "detail": "differs"} for f in fqns]


def _loaded(fqns=REPLICATED[1:], step=0, **extra):
    """The checkpoint oracle's face: what the save took from the rank whose copy drifted."""
    return Verdict.from_dict(finding("checkpoint", _mismatches("loaded.param", fqns, step), **extra))


def _drift(fqns=REPLICATED, step=0):
    return Verdict.from_dict(finding("replica", _mismatches("param", fqns, step)))


def _without_checkpoint_gives(verdict, label):
    """A judge: the case up to its save (no checkpoint) gives ``verdict`` (``label``), every other variant passes."""
    def judge_many(cases):
        return [SimpleNamespace(verdict=verdict, label=label) if c.checkpoint is None
                else SimpleNamespace(verdict=Verdict.from_dict(passing()), label="pass") for c in cases]
    return judge_many


def test_a_checkpoint_face_whose_case_without_the_checkpoint_drifts_before_the_save_is_that_drift():
    """dtensor_replica_step_twice.py met as dtensor.checkpoint.dcp.loaded.param (replicas drifted at step 0, the
    save after step 0 took rank 1's copy of three params: the kernel names the checkpoint at the save's step):
    the case without its checkpoint fails earlier, as the replica oracle, on those params: one bug."""
    case = _ckpt_case()
    (before,) = [v for d, _, v in variants(case, ["SGD"]) if d == "checkpoint"]
    # what ran before the save, no more: no checkpoint, and no step after it (an error there would come first)
    assert before.checkpoint is None and before.schedule == case.schedule[:1] and len(case.schedule) == 2
    table, sigs = generalize(_without_checkpoint_gives(_drift(), "dtensor.replica.param"), case, _loaded(), ["SGD"])
    assert "dtensor.replica.param" in sigs and "dtensor.checkpoint.dcp.loaded.param" in sigs
    assert Face("checkpoint", UP_TO_THE_SAVE, "fails earlier", "dtensor.replica.param") in table
    assert "checkpoint: fails earlier, where it began, with none (its steps up to the save) (dtensor.replica.param)" \
        in table_text(table)
    # the run raised after the load (a known error of a later step): the kernel named the load's divergence, and
    # the whole schedule without the checkpoint raises there first; up to the save, the replicas drift
    def known_error_later(cases):
        return [SimpleNamespace(verdict=_error("RuntimeError", ["x.py"]), label="dtensor.error.fwdbwd.RuntimeError.0")
                if len(c.schedule) > 1 else SimpleNamespace(verdict=_drift(), label="dtensor.replica.param")
                for c in cases]

    then = _loaded(then={"phase": "fwdbwd", "type": "RuntimeError", "message": "m"})
    assert "dtensor.replica.param" in generalize(known_error_later, case, then, ["SGD"])[1]


def test_a_checkpoint_bug_of_its_own_stays_apart_from_what_fails_without_its_checkpoint():
    """No false merge: the case up to its save passes (a bug of the round trip), or fails on other params, or
    with an error (no params named), or (a verdict of another run) after the save: each leaves the finding as
    it is."""
    case, ckpt = _ckpt_case(), _loaded()
    for other, label in ((Verdict.from_dict(passing()), "pass"),
                         (_drift(step=1), "dtensor.replica.param"),  # after the save: not what the save took
                         (_drift(["layers.0.weight"]), "dtensor.replica.param"),  # other params than the load's
                         (_error("RuntimeError", ["x.py"]), "dtensor.error.fwdbwd.RuntimeError.00000000")):
        table, sigs = generalize(_without_checkpoint_gives(other, label), case, ckpt, ["SGD"])
        assert sigs == {"dtensor.checkpoint.dcp.loaded.param"}, (label, table)
        assert not any(f.outcome == "fails earlier" for f in table)
    assert not earlier(ckpt, _drift(), saved_after=-1)  # a drift at step 0 of a save before any step: later
    # where a verdict kept only its first few mismatches, one param in common is enough
    cut = _loaded(["layers.2.bias", "layers.9.weight"], count=40)
    assert earlier(cut, _drift(), saved_after=0) and not earlier(_loaded(["layers.2.bias", "layers.9.weight"]),
                                                                 _drift(), saved_after=0)


# -- one bug across the modules a collective's fault passes through (fuzz --simulate) ----------------------
def _widths(case):
    widths, stack = [case.model.d_in], list(case.model.layers)
    while stack:
        layer = stack.pop()
        widths += [w for w in (layer.d_in, layer.d_out) if w]
        stack += layer.children
    return widths


def _judged_by(fails):
    """A simulated pool's judge: ``fails(case)`` says whether the case fails; it does in its first module."""
    def judged(cases):
        out = []
        for c in cases:
            kind = c.model.layers[0].kind
            v = _step_verdict([f"layers.0"], quantity="forward") if fails(c) else Verdict.from_dict(passing())
            label = f"dtensor.parity.forward.{ {'linear': 'Linear', 'layernorm': 'LayerNorm'}[kind] }"
            out.append(SimpleNamespace(verdict=v, label=label if fails(c) else "pass", known=False))
        return out
    return judged


def _uneven(case) -> bool:
    return any(w % case.ranks for w in _widths(case))


def test_a_collective_bug_over_uneven_shards_from_6_ranks_met_in_two_modules_is_one_finding(tmp_path):
    """tests/planted/uneven_all_gather_from_6_ranks.py (an all-gather of an uneven shard over 6+ ranks loses
    a row) met in a Linear and a LayerNorm: with every shard even it never shows, so the shapes seemed to make
    its onset and each kept its file. With every width uneven at 5 and 6 ranks alike it passes at 5 and fails at
    6: a group size's onset, one bug, one file. A bug of uneven shards alone (any group size) has no onset."""
    import dataclasses

    from fuzzshard.case import Group, Layer, Model
    from fuzzshard.findings.record import Finding, write_finding
    from fuzzshard.findings.onset import fold_one_bug, onset

    collective = _judged_by(lambda c: c.ranks >= 6 and _uneven(c))
    linear = simple_case(6, optim="SGD", placements={"layers.0.weight": ["S0"]})  # widths 5, 7, 3
    norm = dataclasses.replace(linear, model=Model("features", 7, (Layer("layernorm", 7, 7), Layer("linear", 7, 3))),
                               groups=(Group(("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")),),
                               target_options={"placements": {"layers.0.weight": ["S0"]}})
    findings, onsets = [], {}
    for case in (linear, norm):
        j = collective([case])[0]
        f = Finding(j.label, case, j.verdict, environment={}, stage="confirmed")
        onsets[f.signature], rows = onset(f, collective)
        assert onsets[f.signature] == 6, table_text(rows)
        assert "world size, widths x30 + 1 (every shard uneven): fails with 6; passes with 5" in table_text(rows)
        assert "world size, widths x30 (every shard even): passes with 5, 6" in table_text(rows)
        write_finding(tmp_path, f, "# script\n")
        findings.append(f)
    folded = fold_one_bug(findings, onsets, tmp_path)  # the least case keeps its file: the LayerNorm's
    assert folded == {"dtensor.parity.forward.Linear": "dtensor.parity.forward.LayerNorm"}
    assert [p.name for p in tmp_path.glob("*.json")] == ["dtensor.parity.forward.LayerNorm.json"]
    assert json.loads((tmp_path / "dtensor.parity.forward.LayerNorm.json").read_text())["faces"] == \
        ["dtensor.parity.forward.Linear"]
    # uneven shards at any group size: even at 5 ranks it passed, uneven at 5 it fails there too: no onset
    shapes = _judged_by(lambda c: c.ranks >= 2 and _uneven(c))
    tens = dataclasses.replace(linear, model=Model("features", 5, (Layer("linear", 5, 10), Layer("act", act="tanh"),
                                                                   Layer("linear", 10, 15))))
    j = shapes([tens])[0]
    assert onset(Finding(j.label, tens, j.verdict, environment={}, stage="confirmed"), shapes)[0] is None


def test_a_replica_drift_met_as_the_checkpoint_face_it_leaves_too_is_one_finding(tmp_path):
    """tests/planted/dtensor_replica_step_twice.py with every case saved and loaded: a case saved after the
    step that made replicas drift is named by the checkpoint's oracle (DCP took rank 1's copy: loaded.param),
    the others by the replica oracle. Seed 0 meets the checkpoint face first; its case run up to its save fails
    earlier as dtensor.replica.param, so that signature is its face, and the cases met with it later are counted
    there: one file."""
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "dtensor", "--checkpoints", "all", "--max-examples", 40, "--seed", 0,
                "--world-sizes", "2", "--optimizers", "SGD", "--case-timeout", 60, "--out", out,
                setup="dtensor_replica_step_twice.py")
    found = sorted(p.name for p in out.glob("*.json"))
    assert r.returncode == 1 and found == ["dtensor.checkpoint.dcp.loaded.param.json"], f"{found}\n{r.stderr[-3000:]}"
    finding = json.loads((out / found[0]).read_text())
    assert finding["verdict"]["oracle"] == "checkpoint" and finding["verdict"]["first"]["quantity"] == "loaded.param"
    assert "dtensor.replica.param" in finding["faces"] and finding["stage"] == "confirmed"
    assert {"dimension": "checkpoint", "value": UP_TO_THE_SAVE, "outcome": "fails earlier",
            "signature": "dtensor.replica.param"} in finding["generalization"]
    assert "        checkpoint: fails earlier, where it began, with none (its steps up to the save) " \
           "(dtensor.replica.param)" in r.stderr
    assert re.search(r"one bug, also seen as dtensor\.replica\.param.* \([1-9]\d* case\(s\) met it so\)", r.stderr), \
        r.stderr[-3000:]  # the replica face met on its own cases, counted here
    assert "1 new finding(s), one per bug" in r.stderr
