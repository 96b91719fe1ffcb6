"""Tied weights sharded as users shard them (issue 46, item 3): fsdp2's tie in a grouped unit of its own
(fully_shard([embedding, head])), TP's vocabulary-parallel tie (the embedding row-wise, the head column-wise,
one Shard(0) DTensor), pp's tie across the first and the last stage (its grad all-reduced between their
ranks), dtensor's drawn placements on the shared weight. Hand-written cases replayed clean and with a
planted bug (the signature checked), the straight-line scripts under torchrun, the draws and the rules."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from conftest import PLANTED, replay_clean_then_buggy, torchrun
from fuzzshard import targets
from fuzzshard.kernel.targets.pp import schedules
from fuzzshard.scriptgen import straight_script
from tied_cases import tied_case, tied_decoder, tied_topology

SHARDED_EMBEDDING = "tied_sharded_embedding_grad_dropped.py"


def _fsdp2_tie_unit(world=2):
    # vocab 5 over 2 ranks: an uneven dim-0 shard of the tied weight
    return tied_case("fsdp2", world, tied_topology(), {"wrap": ["layers.1"], "reshard_after_forward": True,
                                                      "tie_unit": True})


def _pp_across_ranks():
    return tied_case("pp", 2, tied_topology(), {"schedule": "1F1B", "cuts": [2], "scale_grads": True,
                                                "n_microbatches": 2})


# ---- rules and draws (pure) ----

def _refused(make) -> str:
    from fuzzshard.case import CaseError

    with pytest.raises(CaseError) as e:
        make().check()
    return str(e.value)


def test_the_rules_keep_what_torch_takes_and_refuse_the_rest():
    assert _fsdp2_tie_unit().check() is None and _pp_across_ranks().check() is None
    untied = dataclasses.replace(tied_topology(), tie_head=False)
    assert "no tie" in _refused(lambda: dataclasses.replace(_fsdp2_tie_unit(), model=untied))
    vocab = {"tok_embeddings": "rowwise", "output": "colwise"}
    assert tied_case("tp", 2, tied_decoder(), {"tp": vocab}).check() is None
    # one owner sharded, the other not: no shared weight
    assert "keeps the tie" in _refused(lambda: tied_case("tp", 2, tied_decoder(), {"tp": {"tok_embeddings": "rowwise"}}))
    fsdp = {"scale_grads": False, "n_microbatches": 2, "dp": 2, "reshard_after_forward": False}
    across = tied_case("pp", 4, tied_topology(), {"schedule": "GPipe", "cuts": [2], **fsdp}, mesh=(2, 2))
    assert schedules.tie_span(across) == "ranks" and across.check() is None  # FSDP2 stages, the tie across their ranks
    # a V schedule puts the first and the last stage on pp rank 0: one param in two fully_shard roots
    assert "two stages of one rank" in _refused(lambda: tied_case(
        "pp", 4, tied_topology(), {"schedule": "ZBVZeroBubble", "stages": 2, "cuts": [1, 2, 3], **fsdp}, mesh=(2, 2)))
    assert schedules.tie_span(_pp_across_ranks()) == "ranks"


def test_show_says_how_each_target_shards_the_tie():
    from fuzzshard.findings.record import Finding
    from fuzzshard.report.show import render

    said = {"fsdp2": "own unit fully_shard([layers.0, head])", "pp": "across ranks, grad all-reduced"}
    for case in (_fsdp2_tie_unit(), _pp_across_ranks()):
        text = render(Finding("", case, None))
        assert f"tie       layers.0.weight is head.weight: {said[case.target]}" in text, text


def test_pp_draws_ties_across_ranks_and_across_stages_of_one_rank():
    import fuzzshard.strategies as fst

    spans = set()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="pp", world_sizes=[1, 2, 3], models=("topologies", "decoder")))
    def draw(case):
        assert case.check() is None
        spans.add(schedules.tie_span(case) if case.model.tie_head or case.model.sizes.get("tied") else "untied")

    draw()
    assert {"ranks", "stages", "untied"} <= spans, spans


def test_fsdp2_and_tp_draw_the_tie_as_users_shard_it():
    import fuzzshard.strategies as fst

    seen = set()
    for target, models, word in (("fsdp2", ("topologies",), "own unit"), ("tp", ("decoder",), "vocab-parallel")):
        @settings(max_examples=100, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(fst.cases(target=target, world_sizes=[2], models=models))
        def draw(case):
            assert case.check() is None
            if targets.get(target).spec.tie(case).startswith(word):
                seen.add(target)

        draw()
    assert seen == {"fsdp2", "tp"}


# ---- replays: clean torch passes, the planted bug is caught by its signature ----

def test_fsdp2_tie_in_its_own_unit_sums_both_uses(tmp_path):
    """fully_shard([layers.0, head]) over 2 ranks, the 5-row tied weight sharded unevenly: parity with the
    plain tied model; an embedding whose use of the weight gives it no grad leaves the tied weight's grad
    short by that use's part."""
    out = replay_clean_then_buggy(tmp_path, _fsdp2_tie_unit(), SHARDED_EMBEDDING)
    assert "FAIL: fsdp2.parity.grad" in out and "grad of layers.0.weight after step 0 differs" in out, out


def test_tp_vocab_parallel_tie_sums_both_uses(tmp_path):
    """A tied decoder under TP: the embedding row-wise and the head column-wise share one Shard(0) DTensor
    (torchtitan's re-tie), with sequence and loss parallelism, the vocabulary (5) uneven over 2 ranks."""
    case = tied_case("tp", 2, tied_decoder(), {"tp": {"tok_embeddings": "rowwise", "output": "colwise",
                                                      "layers.0.feed_forward": "mlp"}, "sp": True,
                                               "loss_parallel": True}, batch=2, seq=4)
    out = replay_clean_then_buggy(tmp_path, case, SHARDED_EMBEDDING)
    assert "FAIL: tp.parity.grad" in out and "grad of tok_embeddings.weight after step 0 differs" in out, out


def test_pp_tie_across_ranks_is_one_value_after_each_step(tmp_path):
    """The embedding on rank 0's stage, the tied head on rank 1's: the grad all-reduced between them keeps
    parity; reduced to the first stage's rank only, the head's copy steps with its own part: the replica
    oracle sees the two copies of the tied weight differ after step 0."""
    out = replay_clean_then_buggy(tmp_path, _pp_across_ranks(), "tied_pp_grad_unreduced.py")
    assert "FAIL: pp.replica.grad" in out and "grad of layers.0.weight after step 0 differs between ranks [0] vs [1]" \
        in out, out


# ---- the straight-line scripts under torchrun ----

def test_the_fsdp2_tie_unit_script_finds_the_planted_bug_and_passes_without(tmp_path):
    src = straight_script(_fsdp2_tie_unit(), "tied")
    assert src is not None and src.count("\n") <= 150 and "fully_shard([model.layers[0], model.head]" in src
    (tmp_path / "repro.py").write_text(src)
    buggy = torchrun(tmp_path / "repro.py", 2, "--setup", PLANTED / SHARDED_EMBEDDING, cwd=tmp_path)
    assert buggy.returncode == 1 and "step 0 grad layers.0.weight" in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_the_pp_tie_script_all_reduces_the_tied_grad_and_fails_without(tmp_path):
    """The tied weight's grad all-reduced over a group of the first and the last stage's ranks: PASS; the
    same script with that all-reduce left out (the planted pp bug's shape, written in the user's code): the
    first stage's copy of the tied weight holds the embedding's part alone."""
    src = straight_script(_pp_across_ranks(), "tied")
    line = "    dist.all_reduce(own['layers.0.weight'].grad, group=tie_group)"
    assert src is not None and src.count("\n") <= 150 and line in src and "dist.new_group([0, 1])" in src
    (tmp_path / "repro.py").write_text(src)
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    (tmp_path / "unreduced.py").write_text(src.replace(line, "    pass"))
    bad = torchrun(tmp_path / "unreduced.py", 2, cwd=tmp_path)
    assert bad.returncode == 1 and "step 0 grad layers.0.weight" in bad.stdout, bad.stdout + bad.stderr[-2000:]
