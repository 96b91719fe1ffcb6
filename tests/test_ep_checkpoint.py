"""The ``ep`` target's checkpoints: the experts' params and optimizer state (DTensors sharded on the expert dim over
the ep mesh, on a 2-D [dp, ep] mesh FSDP-sharded over dp too) saved through DSD + DCP and loaded at another world
size and another EP degree, as every state-dict kind of the other targets. Proven by a planted bug (a DCP save that
writes each rank's experts at the mirrored expert offset): the finding's signature is checked, and the straight-line
script's round trip finds it too."""
import dataclasses
import math

from hypothesis import HealthCheck, Phase, settings

from conftest import PLANTED, replay_clean_then_buggy, torchrun
from fuzzshard.case import Checkpoint, Optim
from test_ep import ep_case

BUG = "ep_dcp_expert_offsets_reversed.py"


def ck_case(mesh, ck_mesh, kind="dcp", moe=None) -> object:
    """ep_case's MoE (4 experts) on ``mesh``, SGD with momentum (state to carry), saved after step 0 and loaded on
    ``ck_mesh``."""
    case = ep_case(mesh, moe, steps=2)
    w = math.prod(ck_mesh)
    case = dataclasses.replace(case, optim=Optim("SGD", {"lr": 0.1, "momentum": 0.9}), batch=2 * math.lcm(case.world_size, w),
                               checkpoint=Checkpoint(after=0, kind=kind, world_size=w, mesh_shape=tuple(ck_mesh)))
    case.check()
    return case


def test_experts_saved_on_a_2d_mesh_load_at_another_ep_degree_and_the_planted_offsets_are_found(tmp_path):
    """Saved on [dp 2, ep 2] (the experts FSDP x EP: two shardings of the expert dim), loaded on a 1-D ep mesh of 2
    (world 4 -> 2): clean, the round trip is exact; with the save's expert offsets reversed, the loaded experts
    differ from the saved ones (the checkpoint oracle's loaded.param), and nothing else does."""
    out = replay_clean_then_buggy(tmp_path, ck_case((2, 2), (2,), moe={"shared": 2}), BUG)
    assert "FAIL: ep.checkpoint.dcp.loaded.param" in out, out
    assert "layers.0.experts.w1" in out and "router.gate" not in out and "shared_experts" not in out, out


def test_the_straight_line_script_saves_and_loads_the_experts_and_finds_the_plant(tmp_path):
    """The checkpoint finding's script (< 150 lines, torch only): ExpertParallel on both sides (written once), DSD +
    DCP between them; saved at EP degree 2 and loaded on one rank it passes on torch as it is and fails with the
    planted save."""
    from fuzzshard.scriptgen import fallback_reason, straight_script
    from fuzzshard.verdict import Verdict, finding

    case = ck_case((2,), (1,))
    verdict = Verdict.from_dict(finding("checkpoint", [{"quantity": "loaded.param", "fqn": "layers.0.experts.w1",
                                                        "step": 0, "detail": "x"}]))
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "ep checkpoint", {}, verdict)
    assert src.count("\n") < 150 and "import fuzzshard" not in src, src.count("\n")
    assert src.count("class ExpertParallel") == 1 and src.count("in expert_parallel(model, mesh)") == 2, src
    (tmp_path / "repro.py").write_text(src)
    buggy = torchrun(tmp_path / "repro.py", 2, "--setup", PLANTED / BUG, cwd=tmp_path)
    assert buggy.returncode == 1 and "param layers.0.experts.w1: saved" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_a_checkpoint_loads_only_where_the_experts_divide_over_its_ep_degree():
    """strategies' loading meshes for ep: 2 experts on 4 ranks load on [2, 2] (EP degree 2), not on [4]; every other
    target's meshes are left as they were (its draws too)."""
    from fuzzshard.case import Layer, Model
    from fuzzshard.strategies import _loading_meshes, _meshes, spec_of

    model = Model(input="features", d_in=3, layers=(Layer("moe", 3, 3, moe={"experts": 2}),))
    assert _loading_meshes(spec_of("ep"), 4, 2, model) == [(2, 2)]
    assert _loading_meshes(spec_of("ep"), 3, 2, model) == []
    assert _loading_meshes(spec_of("fsdp2"), 4, 2, model) == _meshes(spec_of("fsdp2"), 4, 2)


def test_a_checkpoint_across_ep_degrees_is_drawn():
    """A DCP checkpoint of an ep case that loads at another EP degree is among the draws (the planted bug's corner)."""
    from hypothesis import find

    from fuzzshard.strategies import cases

    found = find(cases(target="ep", world_sizes=[1, 2, 4], checkpoint=True),
                 lambda c: c.checkpoint.kind == "dcp" and c.checkpoint.mesh_shape[-1] != c.mesh_shape[-1],
                 settings=settings(max_examples=300, database=None, derandomize=True, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    assert found.checkpoint.world_size != found.world_size or len(found.mesh_shape) != len(found.checkpoint.mesh_shape)
