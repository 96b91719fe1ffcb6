"""ep's ``tp`` option: torchtitan's EP + TP (expert TP 1: EP borrows the TP ranks) on a [dp, tp] mesh, the
router under NoParallel with a Partial output grad, the shared expert column-/row-wise, each TP rank routing
its slice of the tokens. Replayed clean, and with a planted bug whose finding's signature is checked."""
import pytest

from conftest import replays_clean
from test_ep import ep_case, replay_both


def test_tp_rules_and_draw():
    """tp needs a 2-D mesh; the draw gives it on 2-D meshes only, never on a checkpoint's loading side, and a
    shrunk case has none; the reducer's mesh edit drops it."""
    import hypothesis.strategies as st
    from hypothesis import HealthCheck, given, settings

    from fuzzshard.case import CaseError
    from fuzzshard.kernel.targets.ep import ep_fit_options as fit_options
    from fuzzshard.strategies import cases

    with pytest.raises(CaseError, match="2-D"):
        ep_case((2,), options={"tp": True})
    assert ep_case((2, 2), options={"tp": True}).target_options == {"tp": True}
    assert fit_options({"tp": True, "reshard_after_forward": True}, (4,), 1) == {"reshard_after_forward": True}
    seen = []

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(target="ep", world_sizes=(2, 4)))
    def collect(case):
        seen.append(case)

    collect()
    tp = [c for c in seen if c.target_options.get("tp")]
    assert tp and all(len(c.mesh_shape) == 2 for c in tp)
    assert not any(c.checkpoint and c.checkpoint.target_options.get("tp") for c in seen)
    assert any(len(c.mesh_shape) == 2 and not c.target_options.get("tp") for c in seen)


def test_tp_with_aux_loss_routing_bias_and_own_units_passes_clean(tmp_path):
    """A batch-wise aux loss (its grad of one on TP rank 0), a routing bias, sigmoid scores normalised and
    applied after the experts, top-2, a shared expert, the router and the shared expert in units of their own."""
    case = ep_case((2, 2), {"shared": 2, "top_k": 2, "aux": "batch", "bias_coeff": 0.25, "score": "sigmoid",
                            "route_norm": True, "score_before_experts": False},
                   {"tp": True, "wrap": ["layers.0.router", "layers.0.shared_experts"], "reshard_after_forward": False})
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    replays_clean(path)


def test_router_grad_unreduced_over_tp_is_found(tmp_path):
    """FSDP2 takes the router gate's TP-Partial grad as its local tensor: the router's grad alone differs at
    step 0 (each TP rank's holds its own tokens' part); the experts' and the shared expert's are right."""
    case = ep_case((2, 2), {"shared": 2, "top_k": 2}, {"tp": True})
    out = replay_both(tmp_path, case, "ep_tp_router_grad_unreduced_over_tp.py")
    assert "FAIL: ep.parity.grad" in out and "grad of layers.0.router.gate.weight after step 0" in out, out
    assert not any(f"{w} step 0" in out for w in ("experts.w1", "experts.w2", "experts.w3", "shared_experts")), out


def test_the_script_falls_back_with_a_reason():
    from fuzzshard.scriptgen import fallback_reason

    from test_ep import _grad_verdict

    why = fallback_reason(ep_case((2, 2), {"shared": 2}, {"tp": True}), {}, _grad_verdict("layers.0.router.gate.weight"))
    assert why and "tp" in why, why

