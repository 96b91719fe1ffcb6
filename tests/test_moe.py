"""The mixture-of-experts layer (fuzzshard/kernel/moe.py): its math against a plain per-token loop, its draws
(shrinking to no MoE), the rules a target sets on it, and the planted load-balancing bug found by a replay."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import replay_clean_then_buggy
from hypothesis import HealthCheck, find, settings

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel.model import build_model, param_shapes
from fuzzshard.kernel.moe import (MoE, aux_loss, capacity_of, grouped_mm_ok, moe_cells, moe_configs_of,
                                  moe_param_shapes, update_expert_bias)


def per_token(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written the slow way: each token, each of its top-k experts, in token order for capacity."""
    c = m.cfg
    B, L, D = x.shape
    xs = x.reshape(-1, D)
    logits = xs @ m.router.gate.weight.T
    scores = torch.sigmoid(logits) if c["score"] == "sigmoid" else torch.softmax(logits, -1)
    choice = scores + (m.expert_bias if m.expert_bias is not None else 0)
    idx = torch.topk(choice, c["top_k"], -1).indices
    cap = capacity_of(c["capacity"], B * L, c["top_k"], c["experts"]) if c["capacity"] is not None else math.inf
    taken = [0] * c["experts"]
    out = torch.zeros_like(xs)
    # capacity goes by slot order: token t's k-th slot is slot t * top_k + k, sorted stably by expert
    slots = sorted(range(B * L * c["top_k"]), key=lambda s: int(idx.reshape(-1)[s]))
    keep = set()
    for s in slots:
        e = int(idx.reshape(-1)[s])
        if taken[e] < cap:
            taken[e] += 1
            keep.add(s)
    for t in range(B * L):
        top = scores[t, idx[t]]
        if c["route_norm"]:
            top = top / top.sum()
        top = top * c["route_scale"]
        for k in range(c["top_k"]):
            if t * c["top_k"] + k not in keep:
                continue
            e = int(idx[t, k])
            w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
            h = lambda v: (F.silu(v @ w1.T) * (v @ w3.T)) @ w2.T  # noqa: E731
            out[t] += h(xs[t] * top[k]) if c["score_before_experts"] else top[k] * h(xs[t])
    if m.shared_experts is not None:
        out += m.shared_experts(xs)
    return out.reshape(B, L, D)


CONFIGS = [
    {},
    {"experts": 4, "top_k": 2, "hidden": 3, "shared": 2, "score": "sigmoid", "route_norm": True, "route_scale": 2.5},
    {"experts": 3, "top_k": 2, "capacity": 0.5, "score_before_experts": False},
    {"experts": 2, "capacity": 1.0, "bias_coeff": 0.25, "aux": "seq"},
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_the_layer_is_its_per_token_math_and_its_shapes_what_param_shapes_says(cfg):
    torch.manual_seed(0)
    m = MoE(4, cfg).double()
    if m.expert_bias is not None:
        m.expert_bias.copy_(torch.tensor([0.3, -0.3]))
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(m(x), per_token(m, x), rtol=1e-12, atol=1e-12)
    assert [(n, tuple(p.shape)) for n, p in m.named_parameters()] == list(moe_param_shapes(4, cfg).items())
    assert m.margin >= 0


def test_grouped_mm_runs_the_experts_as_the_loop_does_where_torch_takes_it_else_the_loop():
    assert grouped_mm_ok(4, 8, torch.float32) and not grouped_mm_ok(4, 4, torch.bfloat16)
    assert not grouped_mm_ok(8, 8, torch.float64)  # "Expected mat_a to be Float32, BFloat16 or Float16"
    for dim, dtype in ((4, torch.float32), (8, torch.bfloat16), (3, torch.float32), (4, torch.float64)):
        outs = []
        for grouped in (False, True):
            torch.manual_seed(1)
            m = MoE(dim, {"experts": 3, "top_k": 2, "hidden": 8, "grouped": grouped}).to(dtype)
            x = torch.randn(2, 3, dim, dtype=dtype, requires_grad=True)
            y = m(x)
            y.square().sum().backward()
            outs.append((y.detach(), m.experts.w1.grad))
        tol = dict(rtol=0, atol=0) if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(outs[0], outs[1], **tol)


def test_the_load_balancing_counts_stay_float32_and_the_bias_moves_by_sign():
    m = MoE(4, {"experts": 3, "bias_coeff": 0.5}).to(torch.bfloat16)
    assert m.tokens_per_expert.dtype == m.expert_bias.dtype == torch.float32
    m.tokens_per_expert.copy_(torch.tensor([300.0, 1.0, 2.0]))  # past bfloat16's exact integers
    update_expert_bias(m)
    # sign(mean - count) = [-1, 1, 1] times 0.5, centred
    torch.testing.assert_close(m.expert_bias, torch.tensor([-2 / 3, 1 / 3, 1 / 3]))
    assert not m.tokens_per_expert.any()


def test_a_sequence_wise_aux_loss_averages_over_ranks_as_the_global_batch_does():
    """What makes it data-parallel: each rank's mean over its sequences, averaged, is the global mean."""
    torch.manual_seed(2)
    scores = torch.softmax(torch.randn(4 * 3, 5, dtype=torch.float64), -1)
    idx = torch.topk(scores, 2, -1).indices
    whole = aux_loss("seq", scores, idx, 4, 2, 1.0)
    halves = [aux_loss("seq", scores[i * 6:(i + 1) * 6], idx[i * 6:(i + 1) * 6], 2, 2, 1.0) for i in range(2)]
    torch.testing.assert_close(whole, sum(halves) / 2)


def topology(cfg: dict, seed: int = 0) -> Model:
    return Model(input="features", d_in=4, layers=(Layer("linear", 4, 4), Layer("moe", 4, 4, moe=cfg)))


def case_of(target: str, cfg: dict, world: int = 2, **kw) -> Case:
    model = topology(cfg)
    return Case(target=target, world_size=world, mesh_shape=(world,), model=model, optim=Optim("SGD", {"lr": 0.1}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(), Step()), frozen=(), batch=4, seq=3,
                dtype="float32", device="cpu", target_options=kw.get("options", {}), seed=kw.get("seed", 0),
                checkpoint=None)


def test_a_case_with_moe_round_trips_and_says_what_it_uses():
    case = case_of("fsdp2", {"experts": 3, "top_k": 2, "bias_coeff": 0.001, "aux": "batch"})
    assert Case.from_json(case.to_json()) == case
    assert "moe" not in Case.from_json(case_of("fsdp2", {}).to_json()).model.layers[0].__dict__.get("moe", {})
    assert moe_cells(case.model) == ["moe", "moe top-k>1", "moe aux batch", "moe expert_bias"]
    assert build_model(case.model, 0, "cpu", torch.float32).layers[1].experts.w1.shape == (3, 1, 4)


@pytest.mark.parametrize("target, cfg, options, why", [
    ("fsdp2", {"capacity": 1.0}, {}, "drops tokens by its own slice"),
    ("fsdp2", {"aux": "batch"}, {"microbatches": 2}, "microbatches"),
    ("pp", {"bias_coeff": 0.001}, {}, "shape-inference forward"),
    ("pp", {"aux": "seq"}, {}, "loss scaling"),
])
def test_the_rule_refuses_what_a_target_cannot_compare(target, cfg, options, why):
    case = dataclasses.replace(case_of(target, cfg), target_options=options)
    assert why in (case.refusal() or "")
    assert case_of("dtensor", {"capacity": 1.0}).refusal() is None  # every forward sees the whole batch


def test_topologies_and_decoders_shrink_to_no_moe_and_an_moe_to_its_plainest():
    import importlib

    sm = importlib.import_module("fuzzshard.strategies.models")

    quiet = settings(database=None, suppress_health_check=list(HealthCheck), max_examples=300)
    assert not moe_configs_of(find(sm.models(2, moe={}), lambda m: True, settings=quiet))
    assert not moe_configs_of(find(sm.decoders(2, moe={}), lambda m: True, settings=quiet))
    m = find(sm.models(1, moe={}), lambda m: bool(moe_configs_of(m)), settings=quiet)
    assert moe_configs_of(m) == [{"experts": 2, "hidden": 1, "top_k": 1}]
    assert not moe_configs_of(find(sm.models(2), lambda m: True, settings=quiet))  # a target without MoE


def test_a_load_balancing_hook_that_does_not_sum_the_counts_over_the_ranks_is_found(tmp_path):
    """tests/planted/moe_bias_local_counts.py: each rank moves its routing bias by its own counts; the
    reference's global counts move it otherwise (seed 0: the two halves of the batch disagree in sign)."""
    case = case_of("fsdp2", {"experts": 3, "top_k": 2, "hidden": 2, "shared": 2, "bias_coeff": 0.001,
                             "aux": "batch"})
    out = replay_clean_then_buggy(tmp_path, case, "moe_bias_local_counts.py")
    assert "FAIL: fsdp2.parity.SGD.forloop.moe.expert_bias" in out, out


def test_dtensor_draws_moe_only_with_models_moe_and_its_default_draws_take_no_byte_for_it():
    """dtensor's Spec.moe "odds" 0 (its MoE runs on full copies: a case with one costs ~3x, docs/search.md): its
    default draws have no MoE and spend no draw on one (a seed's cases are those of the tree before MoE);
    --models moe still puts one in every case; elsewhere one topology in 8 has one, shrinking to none."""
    import importlib

    from hypothesis import Phase, given
    from hypothesis import seed as hseed

    import fuzzshard.strategies as fst
    from fuzzshard import targets

    sm = importlib.import_module("fuzzshard.strategies.models")
    assert fst.moe_odds(targets.get("dtensor").spec) == 0 and fst.moe_odds(targets.get("tp").spec) == sm.MOE_ODDS
    draws = dict(max_examples=200, database=None, phases=[Phase.generate], deadline=None,
                 suppress_health_check=list(HealthCheck))

    def collected(strategy, seed: int) -> list:
        seen = []

        @hseed(seed)
        @settings(**draws)
        @given(strategy)
        def collect(x):
            seen.append(x)

        collect()
        return seen

    none = collected(sm.models(2, moe={}, odds=0), 1)
    plain = collected(sm.models(2), 1)  # no MoE asked for: the same bytes, so the same models
    assert none == plain and not any(moe_configs_of(m) for m in none)
    assert any(moe_configs_of(m) for m in collected(sm.models(2, moe={}, odds=sm.MOE_ODDS), 1))
    assert all(moe_configs_of(c.model) for c in collected(fst.cases(target="dtensor", world_sizes=[1, 2],
                                                                    models=("moe",)), 1)[:20])
    quiet = settings(database=None, suppress_health_check=list(HealthCheck), max_examples=300)
    m = find(sm.models(1, moe={}, odds=sm.MOE_ODDS), lambda m: bool(moe_configs_of(m)), settings=quiet)
    assert moe_configs_of(m) == [{"experts": 2, "hidden": 1, "top_k": 1}]
