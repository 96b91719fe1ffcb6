"""An MoE layer in the straight-line scripts of targets other than ep (scriptgen/common.py's MoE class): a finding in
a dtensor or fsdp2 model with an MoE is written torch-only (< 150 lines), builds the kernel's model bit for bit, and
under torchrun fails with the planted bug where the kernel's replay does and passes on torch as it is."""
import math

import pytest
import torch

from conftest import PLANTED, torchrun
from test_scriptgen import _defs
from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.kernel.model import build_model, param_shapes


def moe_case(target, mesh, options, moe) -> Case:
    """A Linear, then an MoE of 3 experts (hidden 2) over 4 features; Adam, two steps."""
    model = Model(input="features", d_in=3, layers=(Layer("linear", 3, 4, bias=True),
                                                    Layer("moe", 4, 4, moe={"experts": 3, "hidden": 2, **moe})))
    world = math.prod(mesh)
    case = Case(target=target, world_size=world, mesh_shape=tuple(mesh), model=model, optim=Optim("Adam", {"lr": 0.01}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(),) * 2, batch=2 * world, seq=3,
                target_options=options, seed=3)
    case.check()
    return case


CASES = [
    # dtensor: the gate Shard(0) (3 rows over 2 ranks: uneven), the experts' w1 Shard(1); the planted step leaves the
    # last rank's shard of an uneven DTensor untouched: the router's param differs after step 0
    ("dtensor", (2,), {"placements": {"layers.1.router.gate.weight": ["S0"], "layers.1.experts.w1": ["S1"],
                                      "layers.0.weight": ["S0"]}}, {"top_k": 2, "shared": 2},
     "last_shard_untouched.py", ("param", "layers.1.router.gate.weight")),
    # fsdp2 HSDP on 2 x 2, the router its own unit: the planted reduction skips its all-reduce over the replicas
    ("fsdp2", (2, 2), {"wrap": ["layers.1.router"], "reshard_after_forward": False},
     {"top_k": 2, "shared": 2, "score": "sigmoid", "route_norm": True},
     "ep_router_grad_unreduced_over_dp.py", ("grad", "layers.1.router.gate.weight")),
]


@pytest.mark.parametrize("target, mesh, options, moe, bug, where", CASES, ids=["dtensor", "fsdp2_hsdp"])
def test_an_moe_finding_is_written_straight_line_and_replays(tmp_path, target, mesh, options, moe, bug, where):
    from fuzzshard.scriptgen import fallback_reason, straight_script
    from fuzzshard.verdict import Verdict, finding

    case = moe_case(target, mesh, options, moe)
    verdict = Verdict.from_dict(finding("parity", [{"quantity": where[0], "fqn": where[1], "step": 0, "detail": "x"}]))
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, f"{target} moe", {}, verdict)
    assert src.count("\n") < 150 and "import fuzzshard" not in src and "class MoE(nn.Module)" in src, src.count("\n")
    ns = _defs(src)
    got, want = ns["build"](case.seed).state_dict(), build_model(case.model, case.seed, "cpu", torch.float32).state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)  # the kernel's init
    (tmp_path / "repro.py").write_text(src)
    world = math.prod(mesh)
    buggy = torchrun(tmp_path / "repro.py", world, "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode == 1 and f"step 0 {where[0]} {where[1]}: sharded" in buggy.stdout, \
        buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", world, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_what_the_script_does_not_write_falls_back_saying_so():
    from fuzzshard.scriptgen import fallback_reason

    assert fallback_reason(moe_case("dtensor", (2,), {}, {"aux": "seq"})).startswith("an MoE with aux")
    tp = moe_case("fsdp2", (2, 2), {"tp": {"layers.0": "colwise"}}, {})
    assert fallback_reason(tp) == "fsdp2 an MoE layer under TP (the layer sees DTensor activations: the kernel's " \
                                  "MoE._forward_local)"
