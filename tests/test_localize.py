"""The localizer (kernel/localize.py) names the module that made a divergence:
the first whose output differs from the reference's or between the ranks that
each hold a copy, and for an output grad the module whose backward made it."""
import torch
import torch.nn as nn

from fuzzshard.case import Case
from fuzzshard.findings.judge import judge
from fuzzshard.findings.record import load_known
from fuzzshard.findings.rootcause import Matcher
from fuzzshard.kernel.localize import Trace, localize_divergence
from fuzzshard.kernel.oracles import reduction_tolerance

TOL = reduction_tolerance("float32", 8)


def _trace_of(model, x, perturb=None):
    """A plain model's trace of one forward/backward (``perturb``: {fqn: added to that module's output grad})."""
    trace = Trace(model, lambda t, fqn: t, lambda t, fqn: t)
    model(x).sum().backward()
    traced = trace.take()
    trace.remove()
    for i, (name, kind, g, at) in enumerate(traced["bwd"]):
        if name in (perturb or {}):
            traced["bwd"][i] = (name, kind, g + perturb[name], at)
    return traced


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_a_copy_that_differs_between_ranks_names_the_module_that_made_it_not_the_first_reader():
    """Rank 0's Conv1d output is right, rank 1's is not; the head reads rank 1's copy and is the first to
    differ from the reference. The Conv1d is named; a difference within rounding names nothing."""
    x = torch.randn(2, 3)
    want = {"fwd": [("lin", "Linear", x), ("conv", "Conv1d", x * 2), ("head", "Linear", x * 3)], "bwd": []}
    got = {"fwd": [("lin", "Linear", x), ("conv", "Conv1d", x * 2), ("head", "Linear", x * 3 + 1)], "bwd": []}
    assert localize_divergence(got, want, TOL)["module"] == "Linear"  # without the ranks' copies: the reader
    got["replicas"] = {"fwd": {1: {0: x * 2, 1: x * 2 + 0.5}}}
    m = localize_divergence(got, want, TOL)
    assert (m["module"], m["fqn"], m["rank"]) == ("Conv1d", "conv", 1)
    assert "output of conv (Conv1d): rank 1's copy vs rank 0's" in m["detail"], m["detail"]
    nudged = (x * 2).nextafter(torch.full_like(x, float("inf")))  # one ulp: a reduction's order, not a bug
    got["replicas"] = {"fwd": {1: {0: x * 2, 1: nudged}}}
    assert localize_divergence(got, want, TOL)["module"] == "Linear"


def test_an_output_grad_that_differs_is_named_by_the_module_whose_backward_made_it():
    """The first Linear's output grad is made by Tanh's backward (the module that read that output); the last
    module's output grad, read by the loss alone, names that module."""
    x = torch.randn(2, 3)
    want = _trace_of(_model(), x)
    assert want["readers"] == {0: [1], 1: [2]}
    m = localize_divergence(_trace_of(_model(), x, {"0": 1.0}), want, TOL)
    assert (m["quantity"], m["module"], m["fqn"]) == ("backward", "Tanh", "1"), m
    assert m["detail"].startswith("output grad of 0 (Linear): ") and "from the backward of 1 (Tanh)" in m["detail"]
    m = localize_divergence(_trace_of(_model(), x, {"2": 1.0}), want, TOL)
    assert (m["module"], m["fqn"]) == ("Linear", "2"), m
    assert localize_divergence(_trace_of(_model(), x), want, TOL) is None


# the two faces a clean dtensor session (seed 34, torch 2.13.0, CPU) met of the DTensor Conv1d that labels its
# Partial input's unreduced output Replicate, as that session shrank them; before the ranks' copies were compared
# they were dtensor.parity.forward.Linear (the tied head reading rank 1's copy) and .backward.Linear
_ADAMAX = {"name": "Adamax", "kwargs": {"betas": [0.9, 0.999], "eps": 1e-08, "foreach": True, "lr": 0.001,
                                        "maximize": False, "weight_decay": 0.0}}
FORWARD_FACE = {
    "target": "dtensor", "world_size": 2, "mesh_shape": [2], "batch": 1, "seq": 1, "seed": 1, "optim": _ADAMAX,
    "model": {"input": "tokens", "d_in": 1, "tie_head": True, "layers": [
        {"kind": "embedding", "d_in": 1, "d_out": 2}, {"kind": "linear", "d_in": 2, "d_out": 1, "bias": False},
        {"kind": "twice", "d_in": 1, "d_out": 1, "children": [
            {"kind": "linear", "d_in": 1, "d_out": 2}, {"kind": "act", "act": "relu"},
            {"kind": "linear", "d_in": 2, "d_out": 1, "bias": False}]},
        {"kind": "conv1d", "d_in": 1, "d_out": 1, "bias": False}, {"kind": "linear", "d_in": 1, "d_out": 2, "bias": False}]},
    "groups": [{"params": ["layers.0.weight", "layers.1.weight", "layers.2.inner.0.weight", "layers.2.inner.0.bias",
                           "layers.2.inner.2.weight", "layers.3.conv.weight", "layers.4.weight"]}],
    "schedule": [{"set_to_none": False}],
    "target_options": {"placements": {"layers.0.weight": ["S1"], "layers.2.inner.0.weight": ["S0"]}},
}
BACKWARD_FACE = {
    "target": "dtensor", "world_size": 2, "mesh_shape": [2], "batch": 1, "seq": 1, "seed": 0, "optim": _ADAMAX,
    "model": {"input": "tokens", "d_in": 1, "layers": [
        {"kind": "embedding", "d_in": 1, "d_out": 2},
        {"kind": "twice", "d_in": 2, "d_out": 2, "children": [
            {"kind": "act", "act": "relu"}, {"kind": "linear", "d_in": 2, "d_out": 2, "bias": False}]},
        {"kind": "conv1d", "d_in": 2, "d_out": 1}, {"kind": "linear", "d_in": 1, "d_out": 2, "bias": False}]},
    "groups": [{"params": ["layers.0.weight", "layers.1.inner.1.weight", "layers.2.conv.weight", "layers.2.conv.bias",
                           "layers.3.weight"]}],
    "schedule": [{"set_to_none": False}],
    "target_options": {"placements": {"layers.1.inner.1.weight": ["S1"], "layers.3.weight": ["S0"]}},
}
CONV = "dtensor-conv-handlers-skip-redistribution"


def test_the_seed_34_faces_are_named_at_the_conv1d_and_are_its_known_root_cause(fuzz_pool):
    known = load_known()
    matcher = Matcher(known)
    fwd = judge(fuzz_pool, Case.from_dict(FORWARD_FACE), known)
    assert (fwd.signature, fwd.known) == ("dtensor.parity.forward.Conv1d", True), fwd.verdict.to_dict()
    first = fwd.verdict.first
    assert first.fqn == "layers.3.conv" and "rank 1's copy vs rank 0's" in first.detail, first.detail
    bwd = judge(fuzz_pool, Case.from_dict(BACKWARD_FACE), known)
    assert bwd.signature == "dtensor.parity.backward.Conv1d" and not bwd.known, bwd.verdict.to_dict()
    assert bwd.verdict.first.fqn == "layers.2.conv", bwd.verdict.first.detail
    hit = matcher.known_hit(Case.from_dict(BACKWARD_FACE), bwd.verdict)
    assert hit is not None and (hit.root_cause, hit.address) == (CONV, "forward/backward of Conv1d")
    # the same module's divergence on fsdp2 (plain activations, other code) is no hit of DTensor's bug
    assert matcher.known_hit(Case.from_dict({**BACKWARD_FACE, "target": "fsdp2", "target_options": {}}),
                             bwd.verdict) is None


# the 2.9.1 smoke's dtensor case with SGD: a Linear whose bias is Shard(0) over 2 ranks (9 over 2: uneven), a grad
# scaler at 65536
_SCALED_CASE = (
    '{"batch": 1, "checkpoint": null, "device": "cpu", "dtype": "float32", "format": 1, "frozen": [], "groups": '
    '[{"overrides": {}, "params": ["layers.0.weight", "layers.0.bias"]}], "mesh_shape": [2], "model": {"buffer": '
    'false, "d_in": 9, "input": "features", "layers": [{"act": "", "bias": true, "children": [], "d_in": 9, '
    '"d_out": 9, "kernel": 1, "kind": "linear"}], "tie_head": false, "unused": false}, "optim": {"added_at": 0, '
    '"added_groups": 0, "kwargs": {"lr": 0.1}, "name": "SGD", "named": false, "tensor_lr": ""}, "scaler": '
    '{"backoff_factor": 0.5, "growth_factor": 2.0, "growth_interval": 1, "init_scale": 65536.0, "overflow": []}, '
    '"schedule": [{"freeze": [], "set_to_none": false, "unfreeze": []}], "seed": 445, "seq": 1, "target": "dtensor", '
    '"target_options": {"placements": {"layers.0.bias": ["S0"]}}, "world_size": 2}')


def test_a_loss_divergence_under_a_grad_scaler_names_no_module_from_the_scaled_output_grads(tmp_path):
    """The sharded run's traced output grads are of the scaled loss: the reference's are scaled alike before they
    are compared. A mean with a wrong value and a right grad (torch 2.9.1's uneven-shard mean) is a loss finding;
    unscaled, the Linear's output grad read 65536x the reference's and was named (a false culprit)."""
    from conftest import replay_clean_then_buggy

    buggy = replay_clean_then_buggy(tmp_path, Case.from_json(_SCALED_CASE), "dtensor_mean_value_off.py")
    assert "FAIL: dtensor.parity.loss" in buggy and "backward" not in buggy, buggy
