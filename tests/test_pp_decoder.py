"""The ``pp`` target over the decoder transformer: its blocks cut into stages as torchtitan splits a Llama
(the token embedding on the first stage, the final norm and the output head on the last), token inputs on
the first stage's rank, cross-entropy per microbatch on the last; trained in parity with the unsplit decoder,
and a planted schedule bug found through it."""
import dataclasses

from conftest import replays_clean, run_cli
from fuzzshard.case import Case, Group, Model, Optim, Step
from fuzzshard.kernel.model import param_shapes
from fuzzshard.kernel.targets.pp import describe, draws, schedules

SIZES = {"d_in": 5, "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2, "hidden": 3, "mlp": "swiglu",
         "norm": "rms", "causal": True, "tied": False}


def _case(**sizes) -> Case:
    model = Model(input="tokens", d_in=5, layers=(), factory="decoder", sizes={**SIZES, **sizes})
    o = {"schedule": "Interleaved1F1B", "stages": 2, "cuts": [1, 2, 3], "scale_grads": True, "n_microbatches": 2}
    return Case(target="pp", world_size=2, mesh_shape=(2,), model=model, optim=Optim("Adam", {"lr": 0.01}),
                groups=(Group(tuple(param_shapes(model))),), schedule=(Step(), Step()), batch=4, seq=3,
                target_options=o)


def test_pp_cuts_the_decoders_blocks_and_a_tied_head_across_ranks():
    case = _case()
    assert schedules.n_units(case.model) == 4 and draws.check(case) is None
    tied = _case(tied=True)  # the embedding on rank 0's stage 0, the tied head on rank 1's stage 3
    assert draws.check(tied) is None and schedules.tie_span(tied) == "ranks"
    assert "cuts" in draws.check(dataclasses.replace(case, target_options={**case.target_options, "cuts": [1, 2]}))
    # a stage after the first whose input needs no grad: the embedding and block 0 frozen
    frozen = tuple(n for n in param_shapes(case.model) if n.startswith(("tok_embeddings.", "layers.0.")))
    o = {**case.target_options, "schedule": "InterleavedZeroBubble"}
    assert describe.facts(dataclasses.replace(case, frozen=frozen, target_options=o))["split_backward_input_without_grad"]
    assert not describe.facts(dataclasses.replace(case, target_options=o))["split_backward_input_without_grad"]


def test_pp_decoder_trains_in_parity_and_a_planted_looped_bug_is_found(tmp_path):
    """Four blocks on two ranks' two virtual stages each (Interleaved1F1B): the embedding on stage 0, the
    norm and head on stage 3; parity with the unsplit decoder on clean torch, and the looped schedules'
    planted mis-scaling of a later virtual stage's grads is a grad parity finding through the same case."""
    path = tmp_path / "decoder.json"
    path.write_text(_case().to_json())
    replays_clean(path)
    buggy = run_cli("replay", path, setup="pp_looped_stage_scale.py")
    assert buggy.returncode == 1 and "FAIL: pp.parity.grad" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]


def test_pp_decoder_case_gets_a_straight_script():
    """The decoder's stages written out as the kernel cuts them (the embedding on stage 0, norm and head on the
    last): no fallback to the flattened kernel. (Under torchrun it prints PASS on clean torch and FINDING with
    pp_looped_stage_scale.py, as the replay above; measured by hand, not rerun here.)"""
    from fuzzshard.scriptgen import fallback_reason, straight_script

    case = _case()
    assert fallback_reason(case) is None, fallback_reason(case)
    text = straight_script(case)
    assert "class Stage(nn.Module)" in text and "self.tok_embeddings = model.tok_embeddings" in text
    assert "ScheduleInterleaved1F1B(stages" in text and len(text.splitlines()) < 200
