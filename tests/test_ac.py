"""Activation checkpointing on every target (fuzzshard/kernel/ac.py, strategies/ac.py): each form recomputes
bit for bit what the plain forward computed, the rule draws only what torch supports, and a recomputation that
differs from the forward (tests/planted/ac_recompute_perturbed.py) is caught as a grad parity finding."""
import dataclasses
import json
import pathlib

import pytest
import torch

from cases import simple_case
from conftest import replay_clean_then_buggy
from fuzzshard.kernel import ac
from fuzzshard.kernel.model import build_model, loss_fn, make_batch, named_params

BUG = "ac_recompute_perturbed.py"
DATA = pathlib.Path(__file__).parent / "data" / "ac"  # findings of a clean session, triaged as fuzzshard's own


def _grads(case, options):
    model = build_model(case.model, 0, "cpu", torch.float32)
    ac.apply_ac(model, options)
    x, y = make_batch(case.model, 0, 0, 4, 2, "cpu", torch.float32)
    loss_fn(model(x), y).backward()
    return {n: p.grad for n, p in named_params(model).items()}


@pytest.mark.parametrize("how", list(ac.AC_HOWS))
def test_every_form_recomputes_the_plain_grads_bit_for_bit(how):
    """AC on vs off, one process: the same grads, bitwise (each op recomputed on the same inputs), under the
    plain FQNs whatever wrapper the form puts in between."""
    case = simple_case(1)
    plain = _grads(case, {})
    checkpointed = _grads(case, {"ac": ["layers.2", "layers.0"] if how not in ac.AC_REENTRANT else ["layers.2"],
                                 **({"ac_how": how} if how != "composable" else {})})
    assert checkpointed.keys() == plain.keys()
    for n in plain:
        assert torch.equal(checkpointed[n], plain[n]), n


def test_the_rule_draws_only_what_torch_supports():
    case = simple_case(2)

    def refusal(target_options, **kw):
        return dataclasses.replace(case, target_options={**case.target_options, **target_options}, **kw).refusal()

    assert refusal({"ac": ["layers.2"], "ac_how": "utils_reentrant"}) is None
    # reentrant: the module's input must require grad (layers.0 takes the data; a frozen layers.0 gives none)
    assert "input need not require grad" in refusal({"ac": ["layers.0"], "ac_how": "wrapper_reentrant"})
    assert "trains every step" in refusal({"ac": ["layers.2"], "ac_how": "utils_reentrant"},
                                          frozen=("layers.0.weight", "layers.0.bias"))
    assert "no such module" in refusal({"ac": ["layers.1"]})  # the activation owns no param
    assert "one of" in refusal({"ac": ["layers.2"], "ac_how": "nope"})
    fsdp2 = dataclasses.replace(case, target="fsdp2", batch=4, target_options={"ac": ["layers.2"], "ac_how": "utils_reentrant"})
    assert "fsdp2 draws" in fsdp2.refusal()
    zero = dataclasses.replace(case, target="zero", batch=4, target_options={"ddp": {}, "ac": ["layers.2"],
                                                                             "ac_how": "utils_reentrant"})
    assert "under DDP" in zero.refusal()
    # fsdp2's first spelling is read as it was
    assert ac.ac_how({"ac": ["layers.0"]}) == "composable" and ac.ac_how({"ac": ["layers.0"], "ac_wrapper": True}) == "wrapper"


def test_draws_with_ac_are_valid_and_reach_every_form():
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst

    seen = set()
    for target in ("dtensor", "zero"):
        @hseed(2)
        @settings(max_examples=150, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target=target, world_sizes=[1, 2], ac=True))
        def collect(case):
            assert case.refusal() is None
            seen.add(ac.ac_how(case.target_options))

        collect()
    assert seen >= set(ac.AC_HOWS) - {"wrapper_reentrant"}, seen


# (the non-reentrant family, selective AC, is caught by its straight-line script below: one replay is enough)
@pytest.mark.parametrize("target, how, quantity", [
    ("fsdp1", "wrapper_reentrant", "grad layers.0.weight"),  # reentrant: the input grad carries it upstream
])
def test_a_recompute_that_differs_from_the_forward_is_caught(tmp_path, target, how, quantity):
    """A hand-written case passes clean; with the recompute fed a scaled input the grads upstream of the
    checkpointed block differ (reentrant: its input's grad carries the error; non-reentrant forms show it
    inside the block, layers.2.weight: the script test)."""
    case = simple_case(2, optim="Adam")
    extra = {} if target == "dtensor" else {"batch": 4, "target_options": {"wrap": ["layers.2"]}}
    case = dataclasses.replace(case, target=target, **extra)
    case = dataclasses.replace(case, target_options={**case.target_options, "ac": ["layers.2"], "ac_how": how})
    buggy = replay_clean_then_buggy(tmp_path, case, BUG)
    assert f"{target}.parity." in buggy and quantity in buggy, buggy


def _with_ac(case, how, fqns=("layers.2",)):
    return dataclasses.replace(case, target_options={**case.target_options, "ac": list(fqns),
                                                     **({"ac_how": how} if how != "composable" else {})})


def test_the_script_writes_the_ac_call_or_falls_back_honestly():
    """Every target's straight-line script checkpoints as the kernel does; a CheckpointWrapper form only where
    the writer reads plain names through it (fsdp2), elsewhere the flattened kernel."""
    from fuzzshard.scriptgen import fallback_reason, straight_script

    dtensor = simple_case(2, optim="Adam")
    fsdp2 = dataclasses.replace(dtensor, target="fsdp2", batch=4, target_options={})
    calls = {"utils": "utils_checkpoint(f, *a, use_reentrant=False)", "composable": "checkpoint(model.layers[2])",
             "sac": "context_fn=sac_context", "utils_reentrant": "use_reentrant=True",
             "wrapper": "apply_activation_checkpointing(model"}
    for how, call in calls.items():
        case = _with_ac(fsdp2 if how == "wrapper" else dtensor, how)
        src = straight_script(case)
        assert src and call in src and len(src.splitlines()) <= 150, (how, src and len(src.splitlines()))
    why = fallback_reason(_with_ac(dtensor, "wrapper"))
    assert "CheckpointWrapper renames" in why, why


def test_the_script_finds_the_planted_recompute_and_passes_without(tmp_path):
    from test_scriptgen import finds_with_and_passes_without
    from fuzzshard.scriptgen import straight_script

    src = straight_script(_with_ac(simple_case(2, optim="Adam"), "sac"))
    finds_with_and_passes_without(src, BUG, "FINDING: the sharded run differs", "layers.2.weight",
                                  "PASS: the sharded run matches", tmp_path)


def test_a_timed_session_steers_the_ac_forms_least_drawn_first():
    from fuzzshard.session.schedule import Scheduler, features

    s = Scheduler()
    case = _with_ac(simple_case(2), "sac")
    assert ("target option", "ac form sac") in features(case)
    for _ in range(3):
        s.record(case, valid=True)
    forms = s.steer("dtensor", [1, 2], {"ac": True})["steer"]["ac"]
    assert set(forms) == set(ac.AC_HOWS) and forms[-1] == "sac" and forms.count("sac") < forms.count("utils"), forms
    assert "ac" not in s.steer("dtensor", [1, 2], {})["steer"]  # without --ac: no AC drawn, nothing steered


def _finding_case(name):
    from fuzzshard.case import Case

    return Case.from_json(json.dumps(json.loads((DATA / name).read_text())["case"]))


def test_ac_inside_an_moe_run_on_full_copies_is_not_drawn_the_moe_itself_runs(cli, tmp_path):
    """A clean session's finding (dtensor, W=1, AC of layers.2.shared_experts.w1 inside an MoE: "aten.mm.default
    got mixed torch.Tensor and DTensor"): MoE._forward_local swaps plain copies in for its forward only, the
    recompute in backward saw the DTensor params. Refused where the MoE runs so (dtensor, tp: Spec.moe "local");
    checkpointing the whole MoE (its recompute swaps again) replays clean."""
    from fuzzshard import targets

    case = _finding_case("dtensor_ac_inside_moe.json")
    assert "inside the MoE at layers.2" in case.refusal()
    assert "inside the MoE" in ac.ac_moe_problem(case, targets.get("tp").spec, "layers.2.shared_experts.w1")
    assert ac.ac_moe_problem(case, targets.get("fsdp2").spec, "layers.2.shared_experts.w1") is None
    whole = _with_ac(case, "composable", ("layers.2",))
    assert whole.refusal() is None
    path = tmp_path / "case.json"
    path.write_text(whole.to_json())
    out = cli("replay", path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]


def test_sharded_optim_shards_a_param_under_a_checkpoint_wrapper(cli):
    """A clean session's finding (sharded_optim, AC "wrapper" of layers.0.attention_norm whose weight is sharded:
    "KeyError: attribute 'weight' already exists" in shard): shard_parameter was handed the CheckpointWrapper,
    not the module holding the param. Its replay passes."""
    out = cli("replay", DATA / "sharded_optim_wrapper_shard.json")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
