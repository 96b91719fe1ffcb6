"""Dropout under sharding (kernel/dropout.py, docs/oracles.md "Dropout"): the draws, the validity rule, the
reference's replay of each rank's masks, and the planted recomputation that draws a new mask, found by a
replay of a hand-written case and by its straight-line script under torchrun."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from cases import simple_case
from conftest import replay_clean_then_buggy, replays_clean
from fuzzshard.case import Case, CaseError, Group, Layer, Model, Step
from fuzzshard.kernel import dropout
from fuzzshard.kernel.decoder import decoder
from fuzzshard.kernel.model import build_model, loss_fn, param_shapes
from fuzzshard.scriptgen import straight_script
from strategies import cases
from strategies.models import dropouts

MODEL = Model("features", 5, (
    Layer("linear", 5, 7), Layer("act", act="tanh"),
    Layer("residual", 7, 7, children=(Layer("linear", 7, 4), Layer("act", act="relu"), Layer("linear", 4, 7),
                                      Layer("dropout", p=0.5))),
    Layer("linear", 7, 3), Layer("dropout", p=0.25)))


def dropout_case(target="fsdp2", **options) -> Case:
    names = list(param_shapes(MODEL))
    return dataclasses.replace(simple_case(2, optim="Adam"), model=MODEL, groups=(Group(tuple(names[:4])), Group(tuple(names[4:]))),
                               batch=4, seq=3, schedule=(Step(),) * 2, target=target, target_options=options)


def test_a_dropout_layer_round_trips_and_leaves_the_params_where_they_were():
    case = dropout_case(wrap=["layers.2"])
    assert Case.from_json(case.to_json()) == case
    assert '"p"' not in dataclasses.replace(case, model=Model("features", 2, (Layer("linear", 2, 3),))).to_json()
    plain = dataclasses.replace(MODEL, layers=(MODEL.layers[0], MODEL.layers[1],
                                               dataclasses.replace(MODEL.layers[2], children=MODEL.layers[2].children[:3]),
                                               MODEL.layers[3]))
    assert param_shapes(plain) == param_shapes(MODEL)
    assert dropout.has_dropout(MODEL) and not dropout.has_dropout(plain)
    assert dropout.probabilities(MODEL) == [0.5, 0.25]


def test_the_rule_takes_dropout_where_the_target_judges_it_and_refuses_it_elsewhere():
    assert dropout_case(wrap=["layers.2"]).refusal() is None
    assert dropout_case("dtensor", placements={}).refusal() is None
    tp = dataclasses.replace(dropout_case(tp={"layers.0": "colwise"}), world_size=4, mesh_shape=(2, 2), batch=4)
    assert "dropout under tensor parallel" in tp.refusal()
    assert "torch.compile" in dropout_case(compile="before").refusal()
    bad = dataclasses.replace(MODEL, layers=MODEL.layers[:-1] + (Layer("dropout", p=1.0),))
    assert "[0, 1)" in dataclasses.replace(dropout_case(), model=bad).refusal()
    with pytest.raises(CaseError, match="uneven inputs under Join"):
        dataclasses.replace(dropout_case("zero", ddp={}, uneven=[2, 1])).check()


@settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases(target="fsdp2", world_sizes=[1, 2], models=("topologies", "decoder"), dropout=True))
def test_drawn_dropout_cases_are_valid_and_name_no_new_params(case):
    case.check()
    if dropout.has_dropout(case.model):
        assert dropout.mode(case) == "replay"
        assert not case.target_options.get("tp") and not case.target_options.get("compile")


def test_dropout_draws_shrink_to_none():
    from hypothesis import find

    smallest = find(dropouts(Model("features", 2, (Layer("linear", 2, 2),))), lambda m: True)
    assert not dropout.has_dropout(smallest)
    with_it = find(dropouts(Model("features", 2, (Layer("linear", 2, 2),))), dropout.has_dropout)
    assert with_it.layers[-1] == Layer("dropout", p=0.5)  # the plainest: at the end, half the units


def test_the_decoder_draws_its_masks_in_attention_and_on_both_residuals():
    sizes = dict(d_in=5, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, hidden=3, mlp="gelu", norm="rms",
                 causal=True, tied=False)
    torch.manual_seed(0)
    plain = decoder(**sizes)
    torch.manual_seed(0)
    dropped = decoder(**sizes, dropout=0.5)
    assert dict(plain.named_parameters()).keys() == dict(dropped.named_parameters()).keys()
    tokens = torch.randint(0, 5, (2, 4))
    torch.manual_seed(1)
    a = dropped(tokens)
    torch.manual_seed(1)
    assert torch.equal(a, dropped(tokens))  # the same seed, the same masks
    assert not torch.equal(a, dropped(tokens))  # the generator moved on: other masks
    dropped.eval()
    assert torch.allclose(dropped(tokens), plain(tokens))


def test_the_replay_is_each_ranks_slice_from_its_own_seed():
    """What two data-parallel ranks of fsdp2 with 2 microbatches compute, by hand, is the replay's loss."""
    case = dropout_case(wrap=["layers.2"], microbatches=2)
    model = build_model(case.model, 0, "cpu", torch.float32)
    x, y = torch.randn(4, 3, 5), torch.randn(4, 3, 3)
    objective = lambda m, xs, ys, options: loss_fn(m(xs), ys)  # noqa: E731
    by_hand = 0
    for r in range(2):
        torch.random.default_generator.manual_seed(dropout.seed(case.seed, 1, r))
        for i in range(2):
            by_hand = by_hand + loss_fn(model(x[2 * r + i:2 * r + i + 1]), y[2 * r + i:2 * r + i + 1]) / 2
    with dropout.replaying(case, 1, "cpu"):
        replayed = dropout.replayed(objective, 2, 2)(model, x, y, {})
    assert torch.equal(replayed, by_hand / 2)
    assert dropout.draws() is None  # (left when the step is done)


@pytest.mark.parametrize("target, options", [
    ("fsdp2", {"wrap": ["layers.2"], "ac": ["layers.2"]}),  # the composable checkpoint (non-reentrant)
    ("fsdp1", {"ac": ["layers.2"], "ac_how": "utils_reentrant"}),  # torch.utils.checkpoint's reentrant form
    # DDP under a compressing hook, 2 microbatches: ddp's own reference (each rank's microbatches by hand) replays
    ("ddp", {"ac": ["layers.2"], "ac_how": "utils", "microbatches": 2, "hook": {"name": "fp16"}}),
], ids=["fsdp2-composable", "fsdp1-reentrant", "ddp-fp16-hook-microbatches"])
def test_a_recomputation_that_draws_a_new_mask_is_caught(tmp_path, target, options):
    """2 ranks, the residual block (its dropout inside) checkpointed: the clean run keeps parity with the
    reference that replays each rank's masks; a checkpoint that ignores preserve_rng_state recomputes the
    block with another mask, and the grads of the block and of the layer in front of it diverge (the layer
    after it, outside the checkpoint, does not). With 2 microbatches (ddp) the generator the recompute moved
    gives the second microbatch other masks too: its loss differs first, and every grad with it."""
    case = dropout_case(target, **options)
    buggy = replay_clean_then_buggy(tmp_path, case, "dropout_recompute_new_mask.py")
    if options.get("microbatches"):
        assert f"FAIL: {target}.parity.loss" in buggy and "grad layers.2.inner" in buggy, buggy
        return
    assert f"FAIL: {target}.parity.grad" in buggy and "grad of layers.0.weight after step 0" in buggy, buggy
    assert "layers.3.weight step 0" not in buggy, buggy


def test_the_straight_line_script_seeds_and_replays_the_masks(tmp_path):
    from test_scriptgen import finds_with_and_passes_without

    case = dropout_case(wrap=["layers.2"], ac=["layers.2"], microbatches=2)
    src = straight_script(case, "dropout under activation checkpointing")
    assert src is not None and src.count("\n") <= 150
    assert "torch.manual_seed((0 * 1000 + k) * 1000 + rank + 1)" in src and "def replayed(" in src
    finds_with_and_passes_without(src, "dropout_recompute_new_mask.py", "FINDING: the sharded run differs",
                                  "step 0 grad layers.0.weight", "PASS: the sharded run matches", tmp_path)


def test_replica_targets_leave_loss_and_grads_uncompared_and_pass(tmp_path):
    """dtensor on 2 ranks, every param replicated but the block's last weight (Shard(0): the block's output
    sharded on the features, where its mask is drawn on each rank's shard from the rank's own generator): no
    mask the reference could have, so no loss or grad compared; the step and the replicas are, and pass."""
    case = dropout_case("dtensor", placements={"layers.2.inner.2.weight": ["S0"]})
    # (without the top-level dropout: layers.3 reads the sharded features and gives a Partial output, and a
    # dropout of a Partial DTensor raises on CPU, a torch bug: test_a_partial_dtensor_dropout_raises_on_cpu)
    case = dataclasses.replace(case, model=dataclasses.replace(MODEL, layers=MODEL.layers[:-1]))
    assert not dropout.compares_loss_and_grads(case)
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    replays_clean(path)


def test_a_partial_dtensor_dropout_raises_on_cpu(tmp_path):
    """A torch bug (docs/oracles.md, Dropout): F.dropout of a Partial DTensor on a CPU mesh decomposes into
    empty_like (Partial too) and an in-place bernoulli_, which DTensor refuses to redistribute; on CUDA the
    fused native_dropout redistributes its Partial input. Met by every dropout after a layer whose weight is
    sharded on its input features; found as an error only the sharded run raises."""
    from conftest import run_cli

    case = dropout_case("dtensor", placements={"layers.3.weight": ["S1"]})
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    r = run_cli("replay", path)
    if r.returncode == 0:
        pytest.skip("this torch's dropout takes a Partial DTensor: the bug is fixed here")
    assert "FAIL: dtensor.error.fwdbwd.RuntimeError" in r.stdout and "aten.bernoulli_.float" in r.stdout, r.stdout


def test_an_moe_aux_loss_is_averaged_over_the_replayed_ranks_slices(tmp_path):
    """zero on 2 ranks, [embedding, linear, linear, moe (aux "seq"), linear, dropout] (a fuzz finding's case,
    tests/data/moe/zero_dropout_aux_seq.json): the reference replays each rank's slice in a forward of its own,
    and each forward's aux loss takes its grad in the forward (moe.py _AuxLoss); it must take 1/world of it, as
    the ranks' averaged grads do, not the whole (the router's and every earlier layer's grads were 2x the aux
    term: zero.parity.grad of layers.0.weight, 6/21 elements)."""
    case = Case.from_json(open("tests/data/moe/zero_dropout_aux_seq.json").read())
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    replays_clean(path)


def test_a_batch_wise_moe_aux_loss_with_replayed_dropout_is_refused():
    """A batch-wise aux loss's expert counts are the global batch's (all-reduced over the ranks); the replay
    runs each rank's slice in its own forward, whose counts are that slice's: the rule refuses the case where
    more than one rank's slice is replayed, and takes it on one rank."""
    import json

    d = json.loads(open("tests/data/moe/zero_dropout_aux_seq.json").read())
    d["model"]["layers"][3]["moe"]["aux"] = "batch"
    case = Case.from_json(json.dumps(d))
    with pytest.raises(CaseError, match="batch-wise MoE aux loss with dropout"):
        case.check()
    dataclasses.replace(case, world_size=1, mesh_shape=(1,)).check()
