"""Gradient sync over accumulation microbatches (fuzzshard/kernel/sync.py): FSDP2's controls
(set_requires_gradient_sync, set_requires_all_reduce, set_is_last_backward, set_reshard_after_backward,
the divide factor, sum-only comms), FSDP1's no_sync(), and the loss scaled across microbatches (mean, sum,
the global token count). Hand-written cases replayed clean and with each planted bug (its signature
checked), and the straight-line scripts under torchrun."""
import dataclasses

import pytest
import torch

from cases import simple_case
from conftest import replay_clean_then_buggy
from fuzzshard.case import Step
from fuzzshard.kernel import sync


def _case(world, mesh, options, target="fsdp2", m=2, optim="Adam"):
    base = {"wrap": ["layers.0"], "reshard_after_forward": True} if target == "fsdp2" else \
        {"strategy": "FULL_SHARD", "orig_params": True, "wrap": ["layers.0"]}
    case = simple_case(world, optim=optim)
    return dataclasses.replace(case, target=target, mesh_shape=mesh, batch=world * m * 2, schedule=(Step(), Step()),
                               target_options={**base, "microbatches": m, **options})


# ---- pure: the weights, the scale, the rule ----

def test_token_weights_by_block_and_the_global_count():
    s = {"loss": "tokens", "mask": [1, 0, 2, 1]}
    assert sync.weights(s, 8).tolist() == [1, 1, 0, 0, 1, 0, 1, 1]
    y = torch.zeros(8, 2, 3)
    assert sync.token_count(s, None, y) == 5 * 2 * 3  # five weighed samples, six MSE terms each
    assert sync.weights({"loss": "sum"}, 8) is None


def test_the_reference_scales_the_plain_loss_to_the_global_objective():
    from fuzzshard.kernel.targets.fsdp2 import FSDP2Target

    def scale(sync_opts, mesh=(2, 2), m=2):
        case = _case(4, mesh, {"sync": sync_opts}, m=m)
        return sync.reference_scale(FSDP2Target, case, 0)

    assert scale({"skip": "all"}) == 1.0  # mean: FSDP's average of microbatch means / m
    assert scale({"skip": "all", "loss": "sum"}) == 2.0  # the microbatches' grads add up
    assert scale({"skip": "all", "divide": 1.0, "force_sum": True}) == 4.0  # summed over the 4 ranks, not averaged
    assert scale({"skip": "all", "loss": "sum", "divide": 8.0, "force_sum": True}) == 1.0
    assert scale({"skip": "all", "loss": "tokens", "mask": [1] * 8, "divide": 1.0, "force_sum": True}) == 1.0


@pytest.mark.parametrize("options, target, why", [
    ({"sync": {"skip": "all_reduce"}}, "fsdp2", "HSDP's"),
    ({"sync": {"skip": "all", "divide": 1.0}}, "fsdp2", "gloo"),
    ({"sync": {"skip": "all", "loss": "tokens", "mask": [0, 0, 0, 0]}}, "fsdp2", "some tokens"),
    ({"sync": {"skip": "all", "loss": "tokens", "mask": [1, 1, 1]}}, "fsdp2", "divide the batch"),
    ({"sync": {"skip": "all", "loss": "tokens", "mask": [1, 1, 1, 1]}, "nonroot": True}, "fsdp2", "nonroot"),
    ({"sync": {"skip": "all"}, "mp": {"param_dtype": "bfloat16", "reduce_dtype": None, "output_dtype": None,
                                      "cast_forward_inputs": True}}, "fsdp2", "mixed precision"),
    ({"sync": {"skip": "root"}}, "fsdp1", "want one of"),
    ({"sync": {"skip": "all", "last_backward": True}}, "fsdp1", "FSDP1 has no"),
])
def test_what_a_sync_option_cannot_be(options, target, why):
    case = _case(2, (2,), options, target=target)
    assert why in (case.refusal() or ""), case.refusal()


def test_drawn_sync_cases_are_valid():
    """The draws: valid by construction (Case.check), some with sync options."""
    from hypothesis import HealthCheck, given, settings

    from strategies import cases

    seen = set()

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(target="fsdp2", world_sizes=[2, 4]))
    def drawn(case):
        assert case.refusal() is None
        seen.update(sync.sync_cells(case.target_options))

    drawn()
    assert seen, "no sync drawn in 25 cases"


# ---- replays: clean, then with a planted bug (its signature) ----

def test_hsdp_divide_factor_applied_twice_is_caught(tmp_path):
    """HSDP 2 x 2, reduce-scatter every microbatch and all-reduce the last (set_requires_all_reduce), a divide
    factor of 8 with sum-only comms, losses summed over microbatches: clean in parity; a factor applied again
    after the all-reduce halves every grad."""
    case = _case(4, (2, 2), {"sync": {"skip": "all_reduce", "divide": 8.0, "force_sum": True, "loss": "sum"}})
    out = replay_clean_then_buggy(tmp_path, case, "sync_hsdp_divide_twice.py")
    assert "FAIL: fsdp2.parity.grad" in out and "grad of layers.0.weight after step 0 differs" in out, out


def test_fsdp2_no_sync_that_drops_the_accumulated_grad_is_caught(tmp_path):
    """set_requires_gradient_sync(False) on the root only (recurse=False), params kept unsharded between
    microbatches, the loss over the global token count with a rank-0 microbatch that sees no tokens and a
    divide factor of 1 (torchtitan's): clean in parity; the last rank dropping its accumulated grads is caught."""
    case = _case(2, (2,), {"sync": {"skip": "all", "keep_unsharded": True, "last_backward": True, "loss": "tokens",
                                    "mask": [0, 2, 1, 1], "divide": 1.0, "force_sum": True}})
    out = replay_clean_then_buggy(tmp_path, case, "sync_no_sync_drops_accumulated.py")
    assert "FAIL: fsdp2.parity.grad" in out and "after step 0 differs" in out, out


def test_fsdp1_no_sync_that_drops_the_accumulated_grad_is_caught(tmp_path):
    """FSDP1 FULL_SHARD under no_sync() (unsharded grads kept) over 2 microbatches, the loss over the global token
    count with a zero-weight microbatch: clean in parity; the last rank losing what no_sync accumulated is caught."""
    case = _case(2, (2,), {"sync": {"skip": "all", "loss": "tokens", "mask": [0, 0, 1, 2]}}, target="fsdp1")
    out = replay_clean_then_buggy(tmp_path, case, "sync_fsdp1_no_sync_drops.py")
    assert "FAIL: fsdp1.parity.grad" in out and "after step 0 differs" in out, out


# ---- the straight-line scripts, under torchrun ----

@pytest.mark.parametrize("target, options, bug", [
    ("fsdp2", {"sync": {"skip": "root", "keep_unsharded": True, "loss": "tokens", "mask": [1, 0, 2, 1],
                        "divide": 1.0, "force_sum": True}}, "sync_no_sync_drops_accumulated.py"),
    ("fsdp1", {"sync": {"skip": "all", "loss": "sum"}}, "sync_fsdp1_no_sync_drops.py"),
], ids=["fsdp2", "fsdp1"])
def test_the_scripts_write_the_controls_and_find_the_planted_bug(tmp_path, target, options, bug):
    from test_scriptgen import _verdict, finds_with_and_passes_without

    from fuzzshard.scriptgen import fallback_reason, straight_script

    case = _case(2, (2,), options, target=target)
    verdict = _verdict("parity", "grad", 0, "layers.0.weight")
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "planted", {}, verdict)
    assert src.count("\n") <= 150
    assert ("model.set_requires_gradient_sync(i == 1, recurse=False)" in src) == (target == "fsdp2")
    assert ("model.no_sync()" in src) == (target == "fsdp1")
    finds_with_and_passes_without(src, bug, "FINDING: the sharded run differs", "step 0 grad layers.",
                                  "PASS: the sharded run matches the plain one", tmp_path)


def test_the_reducers_mesh_edits_keep_a_sync_case_valid():
    """fit_options: HSDP's all-reduce skip off a 2-D mesh becomes the plain skip, the token mask takes the new
    number of blocks."""
    from fuzzshard.kernel.targets.fsdp2 import fit_options

    opts = {"microbatches": 2, "sync": {"skip": "all_reduce", "loss": "tokens", "mask": [0, 0, 0, 0, 1, 1, 0, 2]}}
    fitted = fit_options(dict(opts), [2], 1)
    assert fitted["sync"] == {"skip": "all", "loss": "tokens", "mask": [0, 0, 0, 1]}
    case = _case(2, (2,), fitted)
    assert case.refusal() is None, case.refusal()
