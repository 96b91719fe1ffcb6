"""torchao's float8 under the tp target (Float8ColwiseParallel / Float8RowwiseParallel; kernel/float8.py):
skipped where torchao is not installed."""
import dataclasses

import pytest

pytest.importorskip("torchao", reason="torchao is not installed (pip install 'fuzzshard[ao]'): its draws are off")


def _tp_float8_case(bias: bool = False):
    from cases import simple_case
    from fuzzshard.case import Group, Layer, Model

    model = Model("features", 5, (Layer("linear", 5, 8, bias=bias), Layer("act", act="tanh"),
                                  Layer("linear", 8, 4, bias=bias)))
    groups = (Group(("layers.0.weight",) + ("layers.0.bias",) * bias),
              Group(("layers.2.weight",) + ("layers.2.bias",) * bias, {"lr": 0.02}))
    return dataclasses.replace(simple_case(2, optim="Adam"), target="tp", batch=4, model=model, groups=groups,
                               target_options={"tp": {"layers.0": "colwise", "layers.2": "rowwise"},
                                               "float8": {"recipe": "tensorwise", "linears": ["layers.0", "layers.2"]}})


def test_float8_tp_is_in_parity_and_a_shard_local_amax_is_caught(tmp_path):
    """Bias-free float8 Linears under torchao's float8 TP styles: in parity with the same float8 model unsharded;
    with a sharded DTensor's amax taken over the local shard, the loss moves at step 0."""
    from conftest import replay_clean_then_buggy

    buggy = replay_clean_then_buggy(tmp_path, _tp_float8_case(), "ao_float8_tp_local_amax.py")
    assert "FAIL: tp.parity.loss" in buggy and "float8 (torchao tensorwise)" in buggy, buggy


def test_a_float8_linear_with_a_bias_is_drawn_under_tp_and_its_bias_grad_is_a_known_torchao_bug():
    """torchao's float8 TP styles cast the output's grad to e5m2 before the bias's grad reads it (a torchao bug,
    docs/ao/float8_tp_bias_grad.py): such a case is valid, drawn, and its finding is a known one (only_when
    float8) whose root cause names torchao."""
    from hypothesis import HealthCheck, given, seed, settings

    import fuzzshard.strategies as fst
    from fuzzshard.findings.record import KNOWN_DIR, _holds, load_finding
    from fuzzshard.findings.rootcause import load_root_causes

    biased = _tp_float8_case(bias=True)
    assert biased.refusal() is None and _tp_float8_case().refusal() is None
    known = load_finding(KNOWN_DIR / "tp.parity.grad.json")
    assert known.root_cause == "torchao-float8-tp-bias-grad-e5m2" and known.case.target_options.get("float8")
    assert _holds(biased, known.only_when) and not _holds(dataclasses.replace(biased, target_options={
        "tp": biased.target_options["tp"]}), known.only_when)
    assert load_root_causes()["torchao-float8-tp-bias-grad-e5m2"].component == "torchao"
    seen = []

    @seed(0)
    @settings(max_examples=30, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="tp", world_sizes=[2], ao=True, checkpoint=False))
    def draws(case):
        f8 = case.target_options.get("float8")
        if f8:
            seen.append(f8["linears"])
            assert set(f8["linears"]) <= set(case.target_options["tp"]) and case.refusal() is None, f8

    draws()


def test_the_decoders_float8_tp_plan_is_drawn_whole_elements_with_prepare_input_only_without_sp():
    """--ao on the decoder under TP: torchtitan's float8 plan over whole attention / MLP elements, a
    PrepareFloat8ModuleInput in front of them drawn only without sequence parallelism (under it that module
    all-gathers in float8, which gloo refuses), and the rule saying so of a hand-made case."""
    from hypothesis import HealthCheck, given, seed, settings

    import fuzzshard.strategies as fst
    from fuzzshard.kernel.float8 import FLOAT8_DECODER_PARTS, float8_tp_problem

    seen = []

    @seed(0)
    @settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="tp", world_sizes=[2], ao=True, checkpoint=False, models=("decoder",)))
    def draws(case):
        f8 = case.target_options.get("float8")
        if f8:
            seen.append(case)
            assert all(fqn.split(".")[2] in FLOAT8_DECODER_PARTS for fqn in f8["linears"]), f8
            assert not (f8.get("prepare_input") and case.target_options.get("sp")), case.target_options

    draws()
    assert seen, "no float8 decoder drawn under TP"
    case = _decoder_case()
    opts = case.target_options
    assert float8_tp_problem(case, opts) is None
    assert "gloo refuses" in float8_tp_problem(case, {**opts, "sp": True})
    part = {**opts, "float8": {**opts["float8"], "linears": ["layers.0.feed_forward.w1"]}}
    assert "every Linear" in float8_tp_problem(case, part)


def _decoder_case():
    from pathlib import Path

    from fuzzshard.case import Case

    return Case.from_json((Path(__file__).parent / "data" / "ao_decoder_float8_tp.json").read_text())


def test_prepare_float8_module_input_in_the_decoders_plan_is_in_parity_and_a_shard_local_amax_is_caught(tmp_path):
    """The decoder's MLP in float8 under TP with PrepareFloat8ModuleInput in front of it (its input cast to float8
    once, for w1): in parity with the same float8 model unsharded; with a sharded DTensor's amax over the local shard,
    the loss moves at step 0."""
    from conftest import replay_clean_then_buggy

    buggy = replay_clean_then_buggy(tmp_path, _decoder_case(), "ao_float8_tp_local_amax.py")
    assert "FAIL: tp.parity.loss" in buggy and "float8 (torchao tensorwise)" in buggy, buggy
