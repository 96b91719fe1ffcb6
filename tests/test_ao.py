"""torchao's float8 training on fsdp2 (fuzzshard/kernel/float8.py): skipped where torchao is not installed."""
import dataclasses

import pytest

from conftest import replay_clean_then_buggy

pytest.importorskip("torchao", reason="torchao is not installed (pip install 'fuzzshard[ao]'): its draws are off")


def _float8_case(float8: dict, world: int = 2, **options):
    from cases import simple_case
    from fuzzshard.case import Group, Layer, Model

    # widths that shard evenly over 2 ranks (uneven: a known torchao bug, torchao-float8-uneven-all-gather)
    model = Model("features", 5, (Layer("linear", 5, 8), Layer("act", act="tanh"), Layer("linear", 8, 4)))
    case = simple_case(world, optim="Adam")
    return dataclasses.replace(case, target="fsdp2", batch=4, model=model,
                               target_options={"wrap": ["layers.0"], "reshard_after_forward": True,
                                               "float8": float8, **options})


def test_the_float8_draw_is_off_unless_asked_and_then_valid():
    from hypothesis import HealthCheck, given, settings

    import fuzzshard.strategies as fst

    seen = []

    @settings(max_examples=30, database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="fsdp2", world_sizes=[1, 2], ao=True, checkpoint=False))
    def draws(case):
        f8 = case.target_options.get("float8")
        if f8:
            seen.append(f8["recipe"])
            assert set(f8["linears"]) and (f8["recipe"] == "tensorwise" or not f8.get("all_gather"))

    draws()
    assert seen, "no float8 drawn in 30 cases"


def test_float8_fsdp2_is_in_parity_and_a_shard_local_amax_is_caught(tmp_path):
    """tensorwise float8 with the float8 all-gather: clean, parity with the same float8 model unsharded; with each
    rank's weight amax over its own shard (the MAX all-reduce skipped), the grads move by far more than the bound."""
    case = _float8_case({"recipe": "tensorwise", "linears": ["layers.0", "layers.2"], "all_gather": True})
    buggy = replay_clean_then_buggy(tmp_path, case, "ao_float8_local_amax.py")
    # the loss (and the grads) of step 0 already: each rank's weight shard cast with its own scale
    assert "FAIL: fsdp2.parity.loss" in buggy and "grad layers.0.weight step 0" in buggy, buggy
    assert "float8 (torchao tensorwise)" in buggy, buggy


@pytest.mark.parametrize("float8, options", [
    ({"recipe": "rowwise", "linears": ["layers.2"], "recompute_bwd": True}, {}),
    ({"recipe": "tensorwise", "linears": ["layers.0"], "all_gather": True, "precompute": True}, {}),
    # converted before the CheckpointWrapper renames layers.0 (its FQN gains _checkpoint_wrapped_module): found by
    # an --ao session, when the conversion came after it and left layers.0 high precision in the sharded run only
    ({"recipe": "rowwise_with_gw_hp", "linears": ["layers.0"]}, {"ac": ["layers.0"], "ac_wrapper": True}),
], ids=["rowwise", "precompute", "ac_wrapper"])
def test_float8_recipes_replay_clean(tmp_path, cli, float8, options):
    path = tmp_path / "case.json"
    path.write_text(_float8_case(float8, **options).to_json())
    r = cli("replay", path)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_float8_case_falls_back_to_the_flattened_kernel_which_finds_the_planted_bug(tmp_path, cli):
    """The straight-line script's unsharded replay is not float8: a float8 case's repro is the flattened kernel,
    saying so; under torchrun it passes clean and fails with the shard-local amax."""
    from conftest import PLANTED, torchrun

    case = tmp_path / "case.json"
    case.write_text(_float8_case({"recipe": "tensorwise", "linears": ["layers.0", "layers.2"],
                                  "all_gather": True}).to_json())
    script = tmp_path / "repro.py"
    assert cli("script", case, "-o", script).returncode == 0
    assert "fallback: fsdp2 options ['float8']" in script.read_text()
    clean = torchrun(script, 2, cwd=tmp_path)
    assert clean.returncode == 0 and "PASS" in clean.stdout, clean.stdout + clean.stderr[-2000:]
    buggy = tmp_path / "buggy.py"
    buggy.write_text(f"import runpy, sys\nsys.path.insert(0, {str(PLANTED)!r})\nimport ao_float8_local_amax\n"
                     f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    found = torchrun(buggy, 2, cwd=tmp_path)
    # the planted bug's face, not any failure: the loss diverges at step 0 (fsdp2.parity.loss, as its replay)
    assert found.returncode != 0 and '"oracle": "parity"' in found.stdout and '"quantity": "loss"' in found.stdout, \
        found.stdout + found.stderr[-2000:]


def test_units_holding_float8_weights_only_are_named_for_the_gloo_rule():
    """FSDP2 all-gathers a unit's inputs in their one dtype (float8, which gloo refuses) or as bytes: the check
    names each unit (deepest first, the root last) whose own params are all converted Linears' weights."""
    from fuzzshard.kernel.float8 import float8_only_units

    shapes = {"a.x.weight": (2, 2), "a.y.weight": (2, 2), "b.weight": (2, 2), "b.bias": (2,)}
    assert float8_only_units(shapes, [], ["a.x", "a.y", "b"]) == []  # the root holds b.bias too
    assert float8_only_units(shapes, ["a", "a.x"], ["a.x", "b"]) == ["a.x"]  # a holds a.y (high precision)
    assert float8_only_units(shapes, ["a", "b"], ["a.x", "a.y", "b"]) == ["a"]


def test_ao_draws_are_steered_to_the_planted_corners_and_shrink_to_off():
    """--ao as a timed session's first round draws it (the schedule's steer): a float8 case runs float32 without a
    checkpoint (else it would be refused), its float8 all-gather runs 2+ steps most often (ao_float8_stale_scale's
    corner), and a low-bit optimizer's checkpoint goes through DCP most often (ao_lowbit_ckpt_scale_shift's);
    the simplest --ao case stays float8-off, with torch's optimizer."""
    from hypothesis import HealthCheck, Phase, find, given, seed, settings

    import fuzzshard.strategies as fst
    from fuzzshard.kernel.lowbit import LOWBIT_OPTIMIZERS
    from fuzzshard.session.schedule import Scheduler

    worlds = [1, 2, 4]
    kw = {"target": "fsdp2", "world_sizes": worlds, "ao": True}
    f8s, gathers, lowbit_cks = [], [], []
    for s in range(10):  # six as `fuzzshard fuzz --ao`, four as with --checkpoints all (ao_lowbit_ckpt_scale_shift's)
        more = {"checkpoint": True} if s >= 6 else {}
        pin = Scheduler().steer("fsdp2", worlds, {"ao": True, **more})

        @seed(s)
        @settings(max_examples=10, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(**kw, **more, **pin))
        def draws(case):
            f8 = case.target_options.get("float8")
            if f8 and not more:
                f8s.append((case.dtype, case.checkpoint))
                if f8.get("all_gather") and case.world_size > 1:
                    gathers.append(len(case.schedule))
            if case.optim.name in LOWBIT_OPTIMIZERS and case.checkpoint:
                lowbit_cks.append(case.checkpoint.kind)

        draws()
    assert f8s and all(d == "float32" and ck is None for d, ck in f8s), f8s
    assert len(gathers) >= 3 and sum(n >= 2 for n in gathers) > len(gathers) / 2, gathers
    # (a session's plan draws each of fsdp2's three kinds alike: a third would be dcp unsteered)
    assert lowbit_cks and lowbit_cks.count("dcp") > len(lowbit_cks) / 3, lowbit_cks
    simplest = find(fst.cases(**kw), lambda c: True, settings=settings(database=None, deadline=None,
                                                                        suppress_health_check=list(HealthCheck)))
    assert not simplest.target_options.get("float8") and simplest.optim.name not in LOWBIT_OPTIMIZERS
