"""Strategies draw valid Cases that round-trip through JSON and build."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import fuzzshard.strategies as fst
from fuzzshard.case import Case, CaseError, Layer, Model
from fuzzshard.kernel.model import build_model, make_batch, param_shapes
from fuzzshard.kernel.optim import param_order

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(fst.cases(world_sizes=[1, 2, 3, 4]))
def test_every_case_round_trips_through_json(case):
    assert Case.from_json(case.to_json()) == case
    assert Case.from_dict(json.loads(case.to_json())) == case


@FAST
@given(fst.cases(world_sizes=[1, 2, 3, 4]))
def test_every_case_is_well_formed_and_builds(case):
    shapes = param_shapes(case.model)
    model = build_model(case.model, case.seed, "cpu", getattr(torch, case.dtype))
    # the pure shape function the strategies use agrees with the real model
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    names = param_order(case)
    assert len(names) == len(set(names)) and set(names) <= set(shapes)
    assert set(case.frozen) <= set(shapes)
    assert case.world_size == torch.Size(case.mesh_shape).numel()
    placements = case.target_options["placements"]
    for n, spec in placements.items():
        assert len(spec) == len(case.mesh_shape)
        assert all(s == "R" or int(s[1:]) < len(shapes[n]) for s in spec)
    x, y = make_batch(case.model, case.seed, 0, case.batch, case.seq, "cpu", getattr(torch, case.dtype))
    assert model(x).shape == y.shape


def test_same_seed_builds_bitwise_the_same_model():
    spec = Model("tokens", 5, (Layer("embedding", 5, 3), Layer("linear", 3, 4), Layer("layernorm", 4, 4)))
    a = build_model(spec, 7, "cpu", torch.float32)
    b = build_model(spec, 7, "cpu", torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"target": "dtensor"}', "missing field"),
        ('{"target": 3, "world_size": 1, "mesh_shape": [1], "model": {}, "optim": {}, "groups": [], "schedule": []}',
         "case.target: expected str"),
    ],
)
def test_unreadable_cases_raise_a_clear_case_error(text, message):
    with pytest.raises(CaseError, match=message):
        Case.from_json(text)


@FAST
@given(fst.cases(target="fsdp2", world_sizes=[1, 2, 3, 4]))
def test_fsdp2_cases_split_the_batch_and_wrap_real_modules(case):
    assert case.batch % (case.world_size * case.target_options.get("microbatches", 1)) == 0  # equal slices
    model = build_model(case.model, case.seed, "cpu", torch.float32)
    opts = case.target_options
    for fqn in opts["wrap"]:
        model.get_submodule(fqn)  # raises if the strategy named a module that does not exist
    if case.model.tie_head:  # FSDP2 requires tied params in one group: the root's
        assert "layers.0" not in opts["wrap"]
    assert opts["reshard_after_forward"] in (True, False) or case.mesh_shape[-1] % opts["reshard_after_forward"] == 0
    if case.checkpoint:  # the loading world splits the same global batch evenly too
        assert case.batch % case.checkpoint.world_size == 0


@FAST
@given(fst.cases(target="fsdp2", world_sizes=[1, 2, 3, 4], checkpoint=True))
def test_checkpoint_cases_save_inside_the_schedule_and_load_on_a_real_world(case):
    ck = case.checkpoint
    case.check_world()
    assert 0 <= ck.after < len(case.schedule)
    assert case.ranks == max(case.world_size, ck.world_size)
    assert Case.from_json(case.to_json()) == case
    model = build_model(case.model, case.seed, "cpu", torch.float32)
    for fqn in ck.target_options["wrap"]:
        model.get_submodule(fqn)


@pytest.mark.parametrize("change, message", [
    ({"world_size": 0, "mesh_shape": [0]}, "checkpoint world size 0 is impossible"),
    ({"mesh_shape": [3]}, r"checkpoint mesh \(3,\) does not hold 2 ranks"),
    ({"after": 5}, "the schedule has 2 steps"),
    ({"mesh_shape": [1, 2]}, r"checkpoint mesh \[1, 2\]: 2 ranks take one of \[\[2\]\]"),  # no subgroups for it
])
def test_impossible_checkpoints_raise_a_clear_case_error(change, message):
    from cases import simple_case

    data = simple_case(2).to_dict()
    data["checkpoint"] = {"after": 0, "kind": "dcp", "world_size": 2, "mesh_shape": [2], **change}
    case = Case.from_dict(data)
    with pytest.raises(CaseError, match=message):
        case.check_world()


@pytest.mark.parametrize("optim, message", [
    ({"added_groups": 1, "added_at": 2}, "added before step 2: the schedule has 2 steps"),
    ({"added_groups": 0, "added_at": 1}, "0 added groups"),
])
def test_impossible_mid_run_param_groups_raise_a_clear_case_error(optim, message):
    from cases import simple_case

    data = simple_case(2).to_dict()
    data["optim"].update(optim)
    with pytest.raises(CaseError, match=message):
        Case.from_dict(data).check_world()


@pytest.mark.parametrize("counts", [[2], [1, 1], [2, 3], [0, 2]])
def test_impossible_uneven_inputs_raise_a_clear_case_error(counts):
    from cases import simple_case

    data = simple_case(2).to_dict()  # 2 ranks, 2 steps
    data["target"], data["target_options"] = "zero", {"ddp": {}, "uneven": counts}  # zero's spec says what may be
    with pytest.raises(CaseError, match="uneven inputs"):
        Case.from_dict(data).check_world()


def test_tensor_parallel_on_a_1d_mesh_raises_a_clear_case_error():
    from cases import simple_case

    data = simple_case(2).to_dict()
    data["target"] = "fsdp2"
    data["target_options"] = {"tp": {"layers.0": "colwise"}}
    with pytest.raises(CaseError, match="tensor parallel needs a 2-D mesh"):
        Case.from_dict(data).check_world()


def test_a_non_root_forward_of_an_unwrapped_module_raises_a_clear_case_error():
    from cases import simple_case

    data = simple_case(2).to_dict()
    data["target"] = "fsdp2"
    data["target_options"] = {"nonroot": True, "wrap": []}
    with pytest.raises(CaseError, match="nonroot calls layers.0 from outside the root"):
        Case.from_dict(data).check_world()


def test_sequence_parallel_on_a_sequence_the_tp_degree_does_not_divide_raises_a_clear_case_error():
    """fsdp2's decoder TP: SP shards the sequence over the TP ranks (the
    strategy draws it a multiple of the degree; a hand-edited case may not)."""
    data = _decoder_case(seq=3, tied=False)
    data["target_options"] = {"tp": {"layers.0.attention": "heads"}, "sp": True, "wrap": []}
    with pytest.raises(CaseError, match="sequence parallelism shards the sequence"):
        Case.from_dict(data).check_world()


def test_tensor_parallel_on_a_tied_embedding_raises_a_clear_case_error():
    """parallelize_module replaces the embedding's weight with a DTensor param,
    so the head keeps the old one: the model is no longer tied (the strategy
    keeps tied owners whole; a hand-edited case once read as a false grad finding)."""
    data = _decoder_case(seq=2, tied=True)
    data["target_options"] = {"tp": {"tok_embeddings": "rowwise"}, "wrap": []}
    with pytest.raises(CaseError, match=r"tensor parallel on \['tok_embeddings'\], which own a tied param"):
        Case.from_dict(data).check_world()
    data["target_options"]["tp"]["output"] = "colwise"  # the vocabulary-parallel pair: both Shard(0), re-tied
    Case.from_dict(data).check_world()
    data["model"]["sizes"]["tied"] = False
    Case.from_dict(data).check_world()


def test_a_targets_coverage_is_what_it_says_of_its_own_options():
    """fsdp2 counts a decoder case by its TP plan's elements (the session summary's
    "passing decoder cases by TP plan element" line); a topology, or a target that
    says nothing (dtensor), counts in no such cell."""
    from cases import simple_case
    from fuzzshard import targets

    data = _decoder_case(seq=2, tied=False)
    data["target_options"] = {"tp": {"layers.0.attention": "heads", "output": "colwise"}, "sp": True, "wrap": []}
    cover = targets.get("fsdp2").spec.coverage
    assert cover(Case.from_dict(data)) == {"decoder cases by TP plan element": {"cases", "heads", "colwise", "sp"}}
    data["target_options"] = {}
    assert cover(Case.from_dict(data)) == {"decoder cases by TP plan element": {"cases", "no TP"}}
    assert cover(simple_case(2)) == {} and targets.get("dtensor").spec.coverage is None


def _decoder_case(seq: int, tied: bool) -> dict:
    """A one-block decoder fsdp2 case on a 2 x 2 mesh, as a dict to edit."""
    from cases import simple_case

    data = simple_case(4).to_dict()
    data.update(target="fsdp2", mesh_shape=[2, 2], seq=seq, batch=4)
    data["model"] = {"input": "tokens", "d_in": 4, "layers": [], "factory": "decoder",
                     "sizes": {"d_in": 4, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "head_dim": 1, "hidden": 2,
                               "mlp": "swiglu", "norm": "rms", "causal": True, "tied": tied}}
    data["groups"] = [{"params": [], "overrides": {}}]
    data["frozen"] = []
    data["schedule"] = [{"set_to_none": True, "freeze": [], "unfreeze": []}]
    return data


def _refused_zero_case() -> Case:
    """ZeRO with uneven inputs under Join and an LR scheduler: a case the validity rule (Case.check) refuses
    (a joined rank's ZeroJoinHook steps without the loop), which a session once drew, ran and reported."""
    import dataclasses

    from cases import simple_case
    from fuzzshard.case import LRScheduler

    ddp = {"broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False,
           "static_graph": False}
    return dataclasses.replace(simple_case(2), target="zero", target_options={"ddp": ddp, "uneven": [1, 2]},
                               lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}))


def test_the_validity_rule_is_one_method_its_old_name_the_same():
    case = _refused_zero_case()
    assert "uneven inputs under Join" in case.refusal()
    with pytest.raises(CaseError, match="uneven inputs under Join"):
        case.check()
    assert Case.check_world is Case.check
    import dataclasses

    assert dataclasses.replace(case, lr_scheduler=None).refusal() is None


def test_a_case_the_rule_refuses_is_invalid_on_the_workers_and_rejected_by_testing_check(fuzz_pool):
    """Whoever sends a refused case to the pool (a session, replay, the reducer) gets an invalid verdict that
    says why, never a finding: every worker asks the rule before it runs a case. The pytest plugin's check()
    rejects it (Hypothesis draws another) without running it."""
    import hypothesis.strategies as st
    from hypothesis import Phase
    from hypothesis.errors import Unsatisfiable

    from fuzzshard import testing

    case = _refused_zero_case()
    runs = len(fuzz_pool.history)
    v = fuzz_pool.run(case).verdict
    assert v.status == "invalid" and v.extra["reason"].startswith("refused: uneven inputs under Join"), v

    @settings(max_examples=2, database=None, phases=[Phase.generate], deadline=None)
    @given(st.just(case))
    def a_users_property(drawn):
        testing.check(fuzz_pool, drawn)

    with pytest.raises(Unsatisfiable):  # every example rejected: none was a test
        a_users_property()
    assert len(fuzz_pool.history) == runs + 1  # testing.check ran nothing
