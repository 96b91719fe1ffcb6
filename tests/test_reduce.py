"""The reducer (fuzzshard/findings/reduce.py): every edit is a well-formed, smaller
case, and a reduction ends 1-minimal. Pure: no process group runs."""
import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings

import fuzzshard.strategies as fst
from cases import simple_case
from fuzzshard import targets
from fuzzshard.case import Case
from fuzzshard.kernel.model import build_model, make_batch, param_shapes
from fuzzshard.findings.reduce import edits, reduce, size

TARGETS = targets.builtin()
FEW = settings(deadline=None, database=None, phases=[Phase.generate],
               suppress_health_check=list(HealthCheck))


def _fqns_in(value) -> list[str]:
    """Strings of target options that name a layer's module or param."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _fqns_in(k) + _fqns_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _fqns_in(v)]
    return [value] if isinstance(value, str) and value.startswith(("layers.", "unused.")) else []


def assert_well_formed(case: Case) -> None:
    case.check_world()
    text = case.to_json()
    assert Case.from_json(text) == case
    shapes = param_shapes(case.model)
    modules = {".".join(n.split(".")[:i]) for n in shapes for i in range(1, n.count(".") + 2)}
    named = [n for g in case.groups for n in g.params] + list(case.frozen)
    named += [n for s in case.schedule for n in (*s.freeze, *s.unfreeze)]
    named += list(case.checkpoint.missing) if case.checkpoint else []
    assert set(named) <= set(shapes)
    sides = [(case.mesh_shape, case.target_options)]
    sides += [(case.checkpoint.mesh_shape, case.checkpoint.target_options)] if case.checkpoint else []
    for mesh, options in sides:
        assert set(_fqns_in(options)) <= modules, options
        for fqn, placement in options.get("placements", {}).items():  # dtensor: one per mesh dim, a dim the param has
            assert len(placement) == len(mesh) and all(p == "R" or int(p[1:]) < len(shapes[fqn]) for p in placement)
    key = json.dumps(json.loads(text)["model"], sort_keys=True)
    if key not in CHAINS:  # once per model: most edits leave it as it is
        CHAINS[key] = chains(case.model)
    assert CHAINS[key], key


CHAINS: dict[str, bool] = {}


def chains(model) -> bool:
    """The widths chain: the model builds and maps a batch to its targets' shape
    (token targets: one logit per vocabulary entry)."""
    x, y = make_batch(model, 0, 0, 1, 2, "cpu", torch.float32)
    out = build_model(model, 0, "cpu", torch.float32)(x)
    return out.shape == y.shape if y.is_floating_point() else out.shape == (*y.shape, model.d_in)


@pytest.mark.parametrize("target,models", [(t, "topologies") for t in TARGETS] + [("fsdp2", "decoder")])
def test_every_edit_is_a_well_formed_smaller_case(target, models):
    @settings(FEW, max_examples=4 if models == "decoder" else 8)  # a decoder's edits each build a model
    @given(fst.cases(target=target, world_sizes=[1, 2, 3, 4], models=(models,)))
    def check(case):
        for what, edited in edits(case):
            assert_well_formed(edited)
            assert size(edited) < size(case), what

    check()


def test_dropping_a_middle_layer_renames_every_later_fqn():
    case = simple_case(2, placements={"layers.0.weight": ["S0"], "layers.2.weight": ["S1"]})
    case = dataclasses.replace(case, frozen=("layers.2.bias",))
    by_what = dict(edits(case))
    no_act = by_what["drop layer layers.1"]
    assert [layer.kind for layer in no_act.model.layers] == ["linear", "linear"]
    assert no_act.groups[1].params == ("layers.1.weight", "layers.1.bias") and no_act.frozen == ("layers.1.bias",)
    assert no_act.target_options["placements"] == {"layers.0.weight": ["S0"], "layers.1.weight": ["S1"]}
    no_first = by_what["drop layer layers.0"]  # its params gone, the next Linear re-fitted to the input
    assert no_first.groups[0].params == () and no_first.model.layers[1].d_in == 5
    assert no_first.target_options["placements"] == {"layers.1.weight": ["S1"]}
    assert "world size 2 -> 1" in by_what and "drop step 1" in by_what and "drop param group 1 (params to group 0)" in by_what


def has_conv_and_two_steps(case: Case) -> bool:
    """A synthetic bug: some conv1d layer, anywhere, and at least two steps."""
    def convs(layers):
        return any(layer.kind == "conv1d" or convs(layer.children) for layer in layers)

    return convs(case.model.layers) and len(case.schedule) >= 2


@settings(max_examples=4, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(fst.cases(target="dtensor", world_sizes=[1, 2, 3, 4]))
def test_reduce_ends_one_minimal_with_only_what_the_bug_needs(case):
    assume(has_conv_and_two_steps(case))
    seen = []
    smallest, kept = reduce(case, has_conv_and_two_steps, on_smaller=seen.append)
    assert has_conv_and_two_steps(smallest)
    assert not any(has_conv_and_two_steps(e) for _, e in edits(smallest))  # 1-minimal
    assert len(seen) == len(kept) and (not seen or seen[-1] == smallest)
    (conv,) = smallest.model.layers
    assert (conv.kind, conv.d_in, conv.d_out, conv.kernel, conv.bias) == ("conv1d", 1, 1, 1, False)
    assert len(smallest.schedule) == 2 and smallest.world_size == 1 and smallest.checkpoint is None
    assert len(smallest.groups) == 1 and not smallest.frozen and smallest.target_options == {}
    assert (smallest.batch, smallest.seq, smallest.dtype) == (1, 1, "float32")


def test_a_spent_budget_returns_the_case_as_it_is():
    case = simple_case(2)
    assert reduce(case, lambda c: True, budget_s=0.0) == (case, [])
