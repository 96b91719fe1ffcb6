"""The straight-line repro (fuzzshard/scriptgen/): a short script built from
the same init, data and bounds as the kernel, which passes on torch as it is
and fails, standalone under torchrun, with a planted bug; for a known finding,
only the check its verdict failed."""
import dataclasses
import difflib
from pathlib import Path

import pytest
import torch
import hypothesis.strategies as st
from hypothesis import HealthCheck, assume, given, settings

from cases import simple_case
from conftest import PLANTED, torchrun
from fuzzshard import targets
from fuzzshard.findings import repro
from fuzzshard.case import Checkpoint, Clip, Group, LRScheduler, Optim, Scaler, Step
from fuzzshard.findings.record import KNOWN_DIR, load_finding, load_known
from fuzzshard.kernel.loop import lr_lambda
from fuzzshard.kernel.model import build_model, make_batch
from fuzzshard.kernel.oracles import mixed_precision_tolerance, reduction_tolerance
from fuzzshard.kernel.reference import reduction_length, reference_error, step_tolerance_for
from fuzzshard.scriptgen import fallback_reason, straight_script, writer, writers
from fuzzshard.verdict import ErrorRecord, Mismatch, Verdict, finding
from strategies import cases

# the whole script for the drawn topologies (up to 4 layers deep, 3 groups, 3 steps, every step compared);
# a finding's script, which checks only what failed, stays under 100 lines for most (ci/script_table.py);
# the device variable and the kernel's bounds, stated, take a few lines more than the 160 this was
LINES = 165
# derandomized: the same draws here as in CI (where Hypothesis's ci profile derandomizes anyway); random draws
# once met a 4-layer fsdp2 case whose whole script was 160 lines, which the bound is not meant to flake on
# mixed precision's parity adds the kernel's replay of FSDP2's casts (mp_grads) and the one-ulp sensitivity
MP_REPLAY = 50
# the training loop's scaler, clip and scheduler, replayed on the plain model too (every step compared)
LOOP_LINES = 45
DRAWN = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def finds_with_and_passes_without(src: str, bug: str, finding: str, shown: str, passing: str, tmp_path) -> None:
    """A 2-rank straight-line script under torchrun: exit 1 with ``finding`` and ``shown`` (where it differs) under
    the planted ``bug``, exit 0 with ``passing`` on stock torch."""
    (tmp_path / "repro.py").write_text(src)
    buggy = torchrun(tmp_path / "repro.py", 2, "--setup", PLANTED / bug, cwd=tmp_path)
    assert buggy.returncode == 1 and finding in buggy.stdout and shown in buggy.stdout, buggy.stdout + buggy.stderr[-2000:]
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and passing in ok.stdout, ok.stdout + ok.stderr[-2000:]


def _defs(src: str) -> dict:
    """The script's imports, classes, functions and constants, without its run (which needs a process group)."""
    import ast

    keep = [node for node in ast.parse(src).body if isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef,
                                                                       ast.FunctionDef))
            or isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] in (["U"], ["device"])]
    ns = {"__name__": "scriptgen_test"}
    exec(compile(ast.Module(keep, []), "repro.py", "exec"), ns)
    return ns


def _check_drawn(case, src: str | None = None, extra: int = 0) -> None:
    src = src or straight_script(case, "drawn")
    if src is None:
        return
    assert src.count("\n") < LINES + MP_REPLAY * ("def mp_grads" in src) + extra
    assert "import fuzzshard" not in src and "from fuzzshard" not in src
    ns = _defs(src)
    dtype = getattr(torch, case.dtype)
    built_as = getattr(torch, case.target_options.get("built_as", case.dtype))
    got, want = ns["build"](case.seed).state_dict(), build_model(case.model, case.seed, "cpu", built_as).state_dict()
    assert list(got) == list(want)
    for k in want:  # the same modules built in the same order under the same seed: the kernel's init, bit for bit
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for k in range(len(case.schedule)):
        x, y = ns["batch"](k)
        x0, y0 = make_batch(case.model, case.seed, k, case.batch, case.seq, "cpu", dtype)
        assert torch.equal(x, x0) and torch.equal(y, y0)


def test_the_scripts_comparison_is_the_kernels():
    """check() of the script fails exactly where the kernel's compare() does."""
    from fuzzshard.kernel.oracles import compare

    ns = _defs(straight_script(simple_case(2)))
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        want = torch.randn(3, 4, generator=g, dtype=torch.float64) * 10 ** (i % 7 - 3)
        got = want + torch.randn(3, 4, generator=g, dtype=torch.float64) * 10 ** (i % 11 - 14)
        if i % 13 == 0:
            got[0, 0] = want[0, 0] = float("nan") if i % 2 else float("inf")
        k = [2, 16, 300][i % 3]
        ours = ns["check"]("x", got, want, k)
        theirs = compare("x", 0, "", got, want, {"k_ulps": k, "u": 2.0 ** -24, "why": ""})
        assert (ours is None) == (theirs is None), (i, ours, theirs)


@DRAWN
@given(cases(target="dtensor", world_sizes=[1, 2]))
def test_drawn_dtensor_cases_give_a_script_that_builds_the_kernels_model_and_data(case):
    from fuzzshard.kernel.moe import moe_configs_of

    why = fallback_reason(case)
    if moe_configs_of(case.model) and why:  # an MoE is written (scriptgen MOE) dropless, without aux loss or bias
        assert why.startswith(("an MoE with", "activation checkpointing of an MoE")), why
        return
    assert straight_script(case) is not None, why  # every one, checkpoint or not
    _check_drawn(case)


@DRAWN
@given(cases(target="fsdp2", world_sizes=[1, 2, 4], checkpoint=False))
def test_drawn_fsdp2_cases_give_a_script_or_none(case):
    # without a checkpoint a case's script is parity: mixed precision replays FSDP2's casts, as the kernel does
    why = fallback_reason(case)
    assert (straight_script(case) is None) == bool(why)
    assert not why or why.startswith(("parity under mixed precision with TP", "parity of a compiled", "an MoE with",
                                      "fsdp2 an MoE layer under TP", "fsdp2 a shared expert")), why  # (MoE: dropless)
    _check_drawn(case)


@settings(DRAWN, max_examples=20)
@given(cases(target="zero", world_sizes=[1, 2, 3]))
def test_drawn_zero_cases_give_a_script_uneven_and_local_too(case):
    """Every drawn ZeRO case: uneven inputs under Join and a loading side resumed with the local optimizer too."""
    src = straight_script(case)
    if src is None and fallback_reason(case).startswith("an MoE layer under zero"):  # only ep's writer writes one
        return
    assert src is not None, fallback_reason(case)
    assert ("with Join([ddp" in src) == bool(case.target_options.get("uneven"))
    _check_drawn(case, src)


def test_what_the_generator_does_not_write_falls_back_to_the_flattened_kernel():
    case = dataclasses.replace(simple_case(2), optim=dataclasses.replace(simple_case(2).optim, name="MyOwnSGD"))
    assert straight_script(case) is None
    why = "the plugin optimizer 'MyOwnSGD', its file not recorded in the finding"
    assert fallback_reason(case) == why and repro.kind_note(case) == f"flattened kernel (fallback: {why})"
    assert "CASE_JSON" in repro.script(case) and f"flattened kernel (fallback: {why})" in repro.script(case)
    assert "flattened kernel (fallback: asked for (--flat))" in repro.script(simple_case(2), flat=True)
    short, flat = repro.script(simple_case(2)), repro.script(simple_case(2), flat=True)
    assert "CASE_JSON" not in short and "def snapshot" in short and "CASE_JSON" in flat


def test_a_findings_script_holds_only_what_its_verdict_needs():
    """An error: the run and no comparison; a checkpoint finding: the round trip and the state compared, no
    plain model; a parity finding: the plain model and no checkpoint."""
    err = Verdict("finding", "error_parity", error=ErrorRecord("RuntimeError", "x", phase="step 0: optimizer.step"))
    ck = dataclasses.replace(simple_case(2), checkpoint=Checkpoint(0, "dcp", 1, (1,)))
    src = straight_script(simple_case(2), "", None, err)
    assert "def check" not in src and "snapshot" not in src and "opt.step()" in src and src.count("\n") < 70
    first = Mismatch("loaded.param_groups.lr", "layers.0.bias", 0, "")
    src = straight_script(ck, "", None, Verdict("finding", "checkpoint", first=first))
    assert "dcp.save" in src and "dcp.load" in src and "plain" not in src and "param group" in src
    assert "state of" not in src and src.count("\n") < 110
    first = Mismatch("param", "layers.2.weight", 0, "")
    src = straight_script(ck, "", None, Verdict("finding", "parity", first=first))
    assert "dcp" not in src and "plain = build(0)" in src and "for k in" not in src
    assert "param {n}" in src and "grad {n}" not in src and "state {n}" not in src  # only the quantity that failed


def _zero_case():
    return dataclasses.replace(simple_case(2, optim="Adam"), target="zero", batch=4, target_options={"ddp": {}})


def _checkpoint_case():
    """Saved on 2 ranks through DCP, loaded on 1: the reshard, and the lr of each group back."""
    return dataclasses.replace(simple_case(2, optim="Adam"), checkpoint=Checkpoint(0, "dcp", 1, (1,)))


def _fsdp2_case():
    return dataclasses.replace(simple_case(2, optim="Adam"), target="fsdp2", batch=4,
                               target_options={"wrap": ["layers.0"], "reshard_after_forward": True})


PLANTED_CASES = [
    # case, (bug file, what the failing run must name: the same divergence the kernel reports)
    # simple_case: two groups with weight decay; layers.0.weight (7, 5) Shard(0) is uneven over 2 ranks
    (simple_case(2), [("skip_weight_decay.py", "step 0 param layers.2.weight"),
                      ("last_shard_untouched.py", "step 0 param layers.0.weight")]),
    (_fsdp2_case(), [("fsdp2_skip_average.py", "step 0 grad layers.0.weight")]),
    # ZeRO's partition loses the last group's last param: nobody steps it
    (_zero_case(), [("zero_drop_last_group_param.py", "step 0 param layers.2.bias")]),
    (_checkpoint_case(), [("ckpt_first_group_lr.py", "param group 1 lr")]),
]


@pytest.mark.parametrize("case, bugs", PLANTED_CASES, ids=["dtensor", "fsdp2", "zero", "dcp_2_to_1"])
def test_the_script_passes_on_torch_and_fails_standalone_with_a_planted_bug(tmp_path, case, bugs):
    src = straight_script(case, "a planted bug")
    assert src is not None and src.count("\n") < LINES
    script = tmp_path / "repro.py"
    script.write_text(src)
    ok = torchrun(script, case.ranks, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    for bug, names in bugs:
        buggy = torchrun(script, case.ranks, "--setup", PLANTED / bug, cwd=tmp_path)
        assert buggy.returncode != 0 and "FINDING" in buggy.stdout and names in buggy.stdout, \
            buggy.stdout + buggy.stderr[-2000:]


def test_a_known_fsdp1_finding_reproduces_the_torch_bug(tmp_path):
    """FSDP1's optim_state_dict_to_load through load_sharded_optimizer_state_dict into HYBRID_SHARD
    (fsdp1-hsdp-sharded-optim-load-group-mismatch): the script's round trip shows it on torch as it is."""
    f = load_finding(KNOWN_DIR / "fsdp1.checkpoint.fsdp1_sharded.loaded.state.exp_avg.json")
    src = straight_script(f.case, "known", f.environment, f.verdict)
    assert src is not None and src.count("\n") < 120 and "load_sharded_optimizer_state_dict" in src
    (tmp_path / "repro.py").write_text(src)
    r = torchrun(tmp_path / "repro.py", f.case.ranks, cwd=tmp_path)
    assert r.returncode != 0 and "FINDING" in r.stdout and f.verdict.first.fqn in r.stdout, \
        r.stdout + r.stderr[-2000:]


def test_writers_are_found_as_targets_are():
    """scriptgen/NAME.py writes target NAME's scripts, found by its module as kernel/targets/NAME.py is (no
    hand-kept list): every built-in target has one, with a writer's entry points; a target with none (a
    plugin's) falls back to the flattened kernel and says why."""
    found = writers()
    assert set(found) == set(targets.builtin())
    assert all(callable(w.unsupported) and hasattr(w, "KINDS") and w.__name__.endswith("." + n) for n, w in found.items())
    assert writer("common") is None and writer("loop") is None  # the writers' helpers are none
    mine = dataclasses.replace(simple_case(2), target="mine")
    assert writer("mine") is None and straight_script(mine) is None
    assert fallback_reason(mine) == "no straight-line writer for the target mine"
    # an oracle whose check the script does not write (a new one): the flattened kernel, saying so
    new = Verdict("finding", "new_check", first=Mismatch("param", "layers.0.weight", 0, ""))
    assert fallback_reason(simple_case(2), verdict=new) == \
        "a finding of the new_check oracle, whose check the script does not write"


def test_oracles_are_found_by_file_name_and_carry_their_script(monkeypatch):
    """oracle/NAME.py is the oracle NAME (no hand-kept list), and the script writer asks the verdict's oracle
    for its plan (``script``) instead of branching on its name: a new oracle whose module plans a parity
    replay gets the parity script, with nothing added to scriptgen."""
    from fuzzshard import oracle

    files = {p.stem for p in Path(oracle.__file__).parent.glob("*.py")} - {"__init__", "common", "source"}
    assert set(oracle.ORACLES) == files and all(o.name == n for n, o in oracle.ORACLES.items())
    assert {n for n, o in oracle.ORACLES.items() if o.script} == {"checkpoint", "parity", "replica"}
    case = simple_case(2)
    parity = Verdict("finding", "parity", first=Mismatch("param", "layers.0.weight", 0, ""))
    new = dataclasses.replace(parity, oracle="new_check")
    monkeypatch.setitem(oracle.ORACLES, "new_check", dataclasses.replace(oracle.ORACLES["parity"], name="new_check"))
    assert fallback_reason(case, verdict=new) is None
    assert straight_script(case, "h", verdict=new) == straight_script(case, "h", verdict=parity) is not None
    # a case and not a finding: what its run checks (the round trip where it checkpoints, else parity)
    ck = dataclasses.replace(case, checkpoint=Checkpoint(0, "full", 2, (2,)))
    assert oracle.checks(case, None).name == "parity" and oracle.checks(ck, None).name == "checkpoint"
    assert oracle.checks(ck, parity).name == "parity"


@settings(max_examples=2, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases(target="dtensor", world_sizes=[1, 2], checkpoint=False, optimizer_names=["SGD", "Adam", "AdamW", "RMSprop"],
             implementation="forloop"))
def test_drawn_cases_pass_on_torch_as_it_is(tmp_path_factory, case):
    """No false positive: drawn cases (away from the recorded torch bugs: a Conv1d
    fed a Partial input) run clean; a too tight bound would fail them."""
    assume(not any(layer.kind == "conv1d" for layer in _layers(case.model.layers)))
    assume(reference_error(case, "cpu", targets.get("dtensor")) is None)  # the plain run accepts the config
    tmp = tmp_path_factory.mktemp("drawn")
    (tmp / "repro.py").write_text(straight_script(case, "drawn"))
    r = torchrun(tmp / "repro.py", case.world_size, cwd=tmp)
    assert r.returncode == 0 and "PASS" in r.stdout, case.to_json() + r.stdout + r.stderr[-2000:]


def _layers(layers):
    for layer in layers:
        yield layer
        yield from _layers(layer.children)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_a_cuda_case_gets_the_same_script_on_its_device():
    """One variable holds the device; the backend follows it (gloo on cpu, NCCL on cuda): nothing else differs."""
    cpu, cuda = straight_script(simple_case(2)), straight_script(dataclasses.replace(simple_case(2), device="cuda"))
    diff = [ln for ln in difflib.ndiff(cpu.splitlines(), cuda.splitlines()) if ln[:1] in "+-"][-2:]  # (after the header's "on cuda")
    assert diff == ["- device = torch.device(\"cpu\")  # the case's device (cuda: one GPU per rank, NCCL)",
                    "+ device = torch.device(\"cuda\", int(os.environ[\"LOCAL_RANK\"]))  # the case's device (cuda: one GPU per rank, NCCL)"]
    assert "{\"cpu\": \"gloo\", \"cuda\": \"nccl\"}[device.type]" in cuda and "torch.cuda.set_device(device)" in cuda


def test_a_bf16_case_gets_a_straight_script_with_the_kernels_bound():
    case = dataclasses.replace(simple_case(2), dtype="bfloat16")
    src = straight_script(case, "bf16")
    assert src is not None and src.count("\n") < LINES and "U = 2.0 ** -8  # unit roundoff of bfloat16" in src
    why = reduction_tolerance("bfloat16", reduction_length(case))["why"]
    assert f"GRAD_ULPS = 2 * 3 * 2 * 7 * 1 * 4  # the kernel's bound: {why}" in src
    assert "def sensitivity(" in src and "sens=sens.get(n, 0.0)" in src  # a low precision: the one-ulp sensitivity too


def test_the_scripts_step_bound_is_the_kernels_for_muon_and_adafactor():
    """Said once, in kernel/reference.py (step_tolerance_for): the script states what it returns."""
    for name, kwargs in (("Muon", {"ns_steps": 3}), ("Adafactor", {})):
        case = dataclasses.replace(simple_case(2), optim=Optim(name, {"lr": 0.01, **kwargs}))
        first = Mismatch("param", "layers.2.weight", 0, "")
        src = straight_script(case, "", None, Verdict("finding", "parity", first=first))
        tol = step_tolerance_for(case, 7 * 5, targets.get("dtensor"))
        assert f"STEP_ULPS, STEP_U = {tol['k_ulps']}, " in src and f"# the kernel's bound: {tol['why']}" in src
        assert ("STEP_U = 48, 2.0 ** -8" in src) == (name == "Muon")  # (Muon: Newton-Schulz in bfloat16, 3 times)


def test_a_decoder_case_gets_a_short_script_that_builds_the_kernels_decoder():
    """The decoder transformer written out (torchtitan's module names): the kernel's init and batches, bit for bit."""
    known = [f for f in load_known().values() if f.case.model.factory == "decoder" and f.case.device == "cpu"]
    assert len(known) >= 10
    for f in known:  # (under torchtitan's TP plan too: the known ones are errors, whose run is written)
        src = straight_script(f.case, "known", f.environment, f.verdict)
        if src is None:  # a writer may fall back for what is not the decoder (ddp's Join), saying why
            why = fallback_reason(f.case, f.environment, f.verdict)
            assert why and "decoder" not in why and f.case.target_options.get("uneven"), (f.case.target, why)
            continue
        assert "class Decoder(nn.Module)" in src and src.count("\n") <= 150
        _check_drawn(f.case, src)
    # the plan in a comparison falls back, saying so (a clean case's grads under it differ from the plain replay's)
    tp = next(f.case for f in known if f.case.target_options.get("tp"))
    assert fallback_reason(tp) == "TP of the decoder transformer (torchtitan's plan) outside an error's run"


def test_a_plugin_optimizer_case_imports_the_plugin_file_and_shows_its_planted_bug(tmp_path, monkeypatch):
    """examples/ortho_momentum.py, by the path the finding records: PASS as it is, FINDING with its planted bug
    (each rank orthogonalizes its own block of the momentum, not the full matrix)."""
    plugin = str(EXAMPLES / "ortho_momentum.py")
    case = simple_case(2, optim="OrthoMomentum", lr=0.02)
    found = Verdict("finding", "parity", first=Mismatch("param", "layers.0.weight", 0, ""))  # the finding's script
    src = straight_script(case, "a plugin's optimizer", {"plugins": [plugin]}, found)
    torch_sgd = straight_script(simple_case(2, lr=0.02), "", None, found)
    assert src is not None and src.count("\n") <= torch_sgd.count("\n") + 8  # the plugin's import: 7 lines, its kwargs and f"PLUGIN = {plugin!r}" in src
    assert "import fuzzshard" not in src and "from fuzzshard" not in src and "OrthoMomentum([" in src
    (tmp_path / "repro.py").write_text(src)
    monkeypatch.delenv("ORTHO_MOMENTUM_BUG", raising=False)
    ok = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    monkeypatch.setenv("ORTHO_MOMENTUM_BUG", "local_shard")
    buggy = torchrun(tmp_path / "repro.py", 2, cwd=tmp_path)
    assert buggy.returncode == 1 and "FINDING" in buggy.stdout and "step 0 param layers.0.weight" in buggy.stdout, \
        buggy.stdout + buggy.stderr[-2000:]


def test_a_mixed_precision_case_replays_fsdp2s_casts_and_shows_a_planted_bug(tmp_path):
    """FSDP2 with MixedPrecisionPolicy(float16): the script replays the casts on each rank's slice, as the kernel's
    reference does, under the kernel's mixed-precision bound; a lost post-divide of the float16 reduction doubles
    the grads at world size 4."""
    mp = {"param_dtype": "float16", "reduce_dtype": "float16", "output_dtype": None, "cast_forward_inputs": True}
    case = dataclasses.replace(simple_case(4), target="fsdp2", world_size=4, mesh_shape=(4,), batch=4,
                               target_options={"wrap": ["layers.0"], "mp": mp}, schedule=(Step(),))
    src = straight_script(case, "mixed precision")
    assert src is not None and src.count("\n") < LINES
    assert f"# the kernel's bound: {mixed_precision_tolerance('float16', 'float16', 4)['why']}" in src
    (tmp_path / "repro.py").write_text(src)
    ok = torchrun(tmp_path / "repro.py", 4, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    buggy = torchrun(tmp_path / "repro.py", 4, "--setup", PLANTED / "fsdp2_fp16_no_postdivide.py", cwd=tmp_path)
    assert buggy.returncode == 1 and "FINDING" in buggy.stdout and "step 0 grad layers.0.weight" in buggy.stdout, \
        buggy.stdout + buggy.stderr[-2000:]


def _replica(quantity: str, fqn: str, step: int = 0) -> Verdict:
    from fuzzshard.verdict import finding

    return Verdict.from_dict(finding("replica", [{"quantity": quantity, "fqn": fqn, "step": step,
                                                   "detail": "rank 1's copy vs rank 0's"}]))


# the planted replica bugs (tests/planted/), on hand-written cases shaped as their shrunk findings: a param
# stepped twice on rank 1 (dtensor, every param Replicate), and a ZeRO load that leaves rank 1's lr as it was
REPLICA_SCRIPTS = [
    ("dtensor_replica_step_twice.py", lambda: dataclasses.replace(simple_case(2, optim="SGD"), target_options={}),
     _replica("param", "layers.0.weight"), "step 0 param layers.0.weight: ranks [0] vs [1]: "
                                           "rank 1's copy vs rank 0's: max abs diff "),
    ("zero_load_lr_one_rank.py", lambda: dataclasses.replace(
        simple_case(2, optim="SGD"), target="zero", target_options={}, batch=4, schedule=(Step(), Step()),
        checkpoint=Checkpoint(0, "consolidate", 2, (2,))),
     _replica("loaded.param_groups.lr", "group 0"), "after the load lr of group 0: ranks [0] vs [1]: "
                                                    "rank 1's copy vs rank 0's: 0.005 vs 0.01"),
]


@pytest.mark.parametrize("bug, make, verdict, shown", REPLICA_SCRIPTS, ids=[b[0][:-3] for b in REPLICA_SCRIPTS])
def test_a_replica_findings_script_prints_which_ranks_differ_with_its_planted_bug_and_passes_without(
        tmp_path, bug, make, verdict, shown):
    """A replica finding's straight-line script trains the case up to the step (or the load) that diverged and
    gathers every rank's copy of what diverged after each: which ranks hold which copy, how far apart."""
    case = make()
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "replica", {}, verdict)
    assert src.count("\n") < 150 and "def replicas(" in src
    finds_with_and_passes_without(src, bug, "FINDING: ranks hold different copies", shown,
                                  "PASS: every rank holds the same", tmp_path)


def test_a_replica_finding_checks_only_what_diverged_and_falls_back_where_its_copies_are_not_observable():
    hsdp = dataclasses.replace(simple_case(4, optim="Adam"), target="fsdp2", mesh_shape=(2, 2), batch=4,
                               target_options={})
    src = straight_script(hsdp, "hsdp", {}, _replica("state.exp_avg_sq", "layers.0.weight"))
    assert "fail += replicas(f\"step {k} exp_avg_sq of\", {n: v for (n, k), v in snapshot(model, opt)[1].items() " \
           "if k == 'exp_avg_sq'})" in src and "def check(" not in src and "k = 0\n" in src  # step 0 only
    grads = straight_script(hsdp, "hsdp", {}, _replica("grad", "layers.0.weight", 1))
    assert grads.index("fail += replicas(f\"step {k} grad\"") < grads.index("opt.step()")  # before the step
    sharded = dataclasses.replace(simple_case(2), target="sharded_optim", target_options={})
    assert fallback_reason(sharded, {}, _replica("param_groups.lr", "group 0")) == \
        "sharded_optim's replicas of param_groups.lr are not observable"


# ---- the training loop around the step (issue 38: kernel/loop.py): scaler, clip, LR scheduler ----

def _loop_case(**loop):
    return dataclasses.replace(simple_case(2, optim="SGD"), **{"schedule": (Step(), Step()), **loop})


def _verdict(oracle, quantity, step, fqn=""):
    return Verdict.from_dict(finding(oracle, [{"quantity": quantity, "fqn": fqn, "step": step, "detail": "x"}]))


def _loop_scripts():
    v = _verdict
    # the planted loop bugs (tests/planted/loop_*.py) on hand-written cases shaped as their findings: each
    # finding's script with its bug; and, clean, the whole loop's (every step, every quantity) and the round trip's
    whole = _loop_case(clip=Clip("norm", 0.01), scaler=Scaler(init_scale=256.0, growth_interval=1, overflow=(1,)),
                       lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}))
    ck = _loop_case(lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}), schedule=(Step(), Step(), Step()),
                    checkpoint=Checkpoint(0, "dcp", 2, (2,)))
    return [
        ("loop_clip_coef_squared.py", whole, v("parity", "clipped_grad", 0, "layers.0.weight"),
         "step 0 clipped grad layers.0.weight: sharded "),
        ("loop_scaler_steps_on_inf.py", whole, v("parity", "param", 1, "layers.0.weight"),
         "step 1 param layers.0.weight: NaN or inf in one run only"),
        ("loop_sched_load_drops_epoch.py", ck, v("checkpoint", "loaded.lr_scheduler.last_epoch", 0),
         "lr_scheduler last_epoch: saved 1, loaded 0"),
        (None, whole, None, "PASS: the sharded run matches the plain one"),
        (None, ck, None, "PASS: the loaded state equals the saved one"),
    ]


@pytest.mark.parametrize("bug, case, verdict, shown", _loop_scripts(),
                         ids=["clip", "scaler", "lr_scheduler", "whole_loop_clean", "round_trip_clean"])
def test_a_loop_findings_script_runs_the_loop_in_torchs_words_and_shows_its_planted_bug(tmp_path, bug, case, verdict,
                                                                                         shown):
    """The script of a case that draws the training loop holds the loop's calls (the scaler's scale, unscale_,
    step and update with the loss made inf at its overflow steps; clip_grad_norm_; the scheduler stepped and
    saved beside the checkpoint) and the plain model's own: a finding's fails with its planted bug, as the kernel
    did; the whole loop's, every step and quantity compared, and the round trip's pass on torch as it is."""
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "loop", {}, verdict)
    assert src.count("\n") < (150 if verdict else LINES) and "import fuzzshard" not in src  # a finding's: < 150
    (tmp_path / "repro.py").write_text(src)
    r = torchrun(tmp_path / "repro.py", 2, *(["--setup", PLANTED / bug] if bug else []), cwd=tmp_path)
    assert r.returncode == (1 if bug else 0) and ("FINDING" in r.stdout) == bool(bug) and shown in r.stdout, \
        r.stdout + r.stderr[-2000:]


def test_the_loop_is_written_in_torchs_words_and_only_where_a_finding_needs_it():
    scripts = {b: (c, straight_script(c, "loop", {}, v)) for b, c, v, _ in _loop_scripts() if b}
    _, clip = scripts["loop_clip_coef_squared.py"]
    assert "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=2.0)" in clip
    assert "norm_p = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01, norm_type=2.0)" in clip
    assert "dist.all_gather_object(every, " in clip and "k = 0\n" in clip  # every rank's norm; step 0 only
    assert "opt_p.step()" not in clip and "sched_p" not in clip and "scaler_p" not in clip  # the norm: grads only
    _, scaler = scripts["loop_scaler_steps_on_inf.py"]
    assert "scaler = torch.amp.GradScaler(device.type, init_scale=256.0, growth_interval=1)" in scaler
    assert "(scaler.scale(loss) * (float(\"inf\") if k in [1] else 1.0)).backward()" in scaler
    assert scaler.index("scaler.unscale_(opt)") < scaler.index("scaler.step(opt)") < scaler.index("scaler.update()")
    assert "for k in [0, 1]:" in scaler and "scaler_p.step(opt_p)" in scaler  # the scale carries over: every step
    case, sched = scripts["loop_sched_load_drops_epoch.py"]
    assert "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)" in sched and "sched.step()" in sched
    assert "dcp.save({\"loop\": loop_sd}" in sched and "sched.load_state_dict(loop_sd[\"lr_scheduler\"])" in sched
    assert "param {n}: saved" not in sched  # only what the finding is about
    full = straight_script(dataclasses.replace(case, checkpoint=dataclasses.replace(case.checkpoint, kind="full",
                                                                                    split=True)), "loop")
    assert "torch.save(loop_sd, f\"{ckpt}/loop.pt\")" in full and "param {n}: saved" in full  # no verdict: all
    # an error in the clip (clip_grad_value_ on a Partial grad): the run up to it, in torch's words, nothing else
    err = Verdict("finding", "error_parity", error=ErrorRecord("RuntimeError", "x", phase="step 0: clip grads (value)"))
    src = straight_script(_loop_case(clip=Clip("value", 1.0)), "", None, err)
    assert "torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)\nopt.step()" in src and "def check" not in src
    # ReduceLROnPlateau fed the step's global loss, on both sides; LambdaLR's named lambda as the kernel's
    plateau = _loop_case(lr_scheduler=LRScheduler("ReduceLROnPlateau", {"factor": 0.5, "patience": 0}))
    src = straight_script(plateau, "", None, _verdict("parity", "loop.last_lr", 1))
    assert "sched.step(full_loss)" in src and "sched_p.step(ran[k][\"loss\"])" in src and "get_last_lr()" in src
    for kw in ({"lambda": "linear_warmup", "warmup": 2}, {"lambda": "exponential", "factor": 0.5}):
        src = straight_script(_loop_case(lr_scheduler=LRScheduler("LambdaLR", kw)), "")
        fn = eval(src.split("LambdaLR(opt, ")[1].split(")\n")[0])
        assert [fn(k) for k in range(5)] == [lr_lambda(kw)(k) for k in range(5)]
    own = dataclasses.replace(simple_case(2), target="fsdp1", target_options={}, clip=Clip("own", 1.0))
    src = straight_script(own)  # FSDP1's own clip_grad_norm_ on the sharded side, torch.nn.utils' on the plain one
    assert "norm = model.clip_grad_norm_(1.0, norm_type=2.0)" in src and "norm_p = torch.nn.utils.clip_grad_norm_(" in src
    zero = straight_script(dataclasses.replace(_zero_case(), clip=Clip("norm", 1.0), lr_scheduler=plateau.lr_scheduler))
    assert "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=2.0)\n" in zero  # plain grads
    assert "dist.all_reduce(full_loss, group=opt.process_group)" in zero and "full_tensor" not in zero


@settings(DRAWN, max_examples=25)
@given(st.sampled_from(["dtensor", "fsdp2", "tp", "zero", "fsdp1"]).flatmap(
    lambda t: cases(target=t, world_sizes=[1, 2, 4] if t == "fsdp2" else [1, 2],
                    loop=("clip", "lr_scheduler", "scaler"))))
def test_drawn_loop_cases_give_a_script_that_builds_the_kernels_model_and_data(case):
    why = fallback_reason(case)
    assert (straight_script(case) is None) == bool(why)
    assert not why or why.startswith(("parity under mixed precision", "parity of a compiled", "a grad scaler under",
                                      "ReduceLROnPlateau fed", "fsdp1's grads are not observable",  # (flat params)
                                      "fsdp1 resumed without FSDP (local) with its own clip",
                                      "sync options beside a checkpoint", "an MoE layer under", "an MoE with",
                                      "fsdp2 an MoE layer under TP", "fsdp2 a shared expert",
                                      "fsdp1 sync options beside a checkpoint",  # (a writer's reason: its target first)
                                      "fsdp2 sync options beside a checkpoint")), why
    src = straight_script(case, "drawn")
    if src is not None:
        compile(src, "repro.py", "exec")
        _check_drawn(case, src, extra=LOOP_LINES * bool(case.clip or case.scaler or case.lr_scheduler))


def test_a_non_root_forward_is_in_the_plain_models_loss_too():
    """fsdp2's ``nonroot``: the kernel's objective adds layers.0 called on the input; the plain replay adds it too
    (without it the grads of layers.0 differ on torch as it is)."""
    case = dataclasses.replace(_fsdp2_case(), target_options={"wrap": ["layers.0"], "nonroot": True})
    src = straight_script(case, "nonroot")
    assert "(((plain(x) - y) ** 2).mean() + plain.layers[0](x).square().mean()).backward()" in src


def test_fsdp2s_grad_scaler_is_the_kernels_sharded_one_or_amps():
    case = dataclasses.replace(_fsdp2_case(), scaler=Scaler(init_scale=16.0))
    src = straight_script(case, "fsdp2")
    assert "scaler = ShardedGradScaler(device.type, process_group=mesh.get_group(), init_scale=16.0)" in src
    assert "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler" in src
    assert "scaler_p = torch.amp.GradScaler(device.type, init_scale=16.0)" in src  # the plain model's: amp's
    amp = straight_script(dataclasses.replace(case, scaler=Scaler(init_scale=16.0, amp=True)), "fsdp2")
    assert "ShardedGradScaler" not in amp and "scaler = torch.amp.GradScaler(device.type, init_scale=16.0)" in amp


# ---- issue 45: FSDP1's loop, ZeRO's uneven inputs and local resume, pipeline checkpoints (test_pp_script.py) ----

# the known findings that fell back to the flattened kernel before these writers, each now a straight-line script
# (the pipeline's async save on [pp, dp] with 7 layers and 3 groups: the one over 150 lines)
NEWLY_STRAIGHT = {
    "fsdp1.error.clip.RuntimeError.1d32b259": "model.clip_grad_norm_(0.1, norm_type=2.0)",
    "fsdp1.parity.SGD.fused.param": "ShardedGradScaler(device.type, process_group=dist.group.WORLD, init_scale=65536.0)",
    "fsdp1.parity.SGD.fused.state.momentum_buffer": "scaler_p.step(opt_p)",
    "fsdp1.parity.grad.appeared": "FSDP.summon_full_params(model, writeback=False, with_grads=True)",
    "pp.checkpoint.dcp.loaded.state.extra": "get_optimizer_state_dict(part, opt, options=FLAT)",
    "pp.checkpoint.dcp.loaded.state.missing": "set_state_dict(part, opt, model_state_dict=sd[\"model\"]",
    "pp.error.load.IndexError.f71717f9": "dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt))",
    "pp.error.load.RuntimeError.7ff5b0d6": "dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(ckpt), async_stager=stager",
    "zero.hang.other.all_reduce": "with Join([ddp, Shadow(seen_grads), opt, Shadow(seen_step)]):",
    # parity after a load: the loading side's steps (here FSDP1's local resume) replayed from the loaded state
    "fsdp1.parity.AdamW.forloop.param": "after = [None] * 2 + [snapshot(model, opt)]  # the loaded state",
    # torchtitan's TP plan of the decoder (kernel/decoder.py parallelize_decoder), an error's run
    "fsdp2.error.fwdbwd.RuntimeError.48c46939": "parallelize_module(model.layers['0'], mesh[\"d1\"], "
                                                "{'feed_forward.w1': ColwiseParallel(), 'feed_forward.w2': RowwiseParallel(",
    "fsdp2.error.load.RuntimeError.56cd5e7e": "'feed_forward.w3': ColwiseParallel()",
}
LONGER = {"pp.error.load.RuntimeError.7ff5b0d6": 190, "fsdp1.parity.AdamW.forloop.param": 170}  # 7 and 5 layers


def test_fsdp1s_loop_pipeline_checkpoints_and_zeros_join_get_straight_scripts_for_their_known_findings():
    """Each known finding of these writers: a script (no fallback marker) that compiles, builds the kernel's model
    and data, and holds the finding's own torch calls (each reproduces under torchrun: ci/script_table.py); every
    known finding left on the flattened kernel has its root cause's hand-reduced script (known/minimal/)."""
    from fuzzshard.findings.rootcause import load_root_causes

    known = load_known()
    for sig, call in NEWLY_STRAIGHT.items():
        f = known[sig]
        src = straight_script(f.case, "known", f.environment, f.verdict)
        assert src is not None and fallback_reason(f.case, f.environment, f.verdict) is None, sig
        assert call in src and "flattened" not in src.lower() and "CASE_JSON" not in src, sig
        assert src.count("\n") <= LONGER.get(sig, 150), (sig, src.count("\n"))
        compile(src, sig, "exec")
        _check_drawn(f.case, src, extra=30)
    causes, root = load_root_causes(known), Path(__file__).resolve().parents[1]
    for sig, f in known.items():
        why = fallback_reason(f.case, f.environment, f.verdict)
        if why:  # (none left on the known list: any new one must come with its root cause's hand-reduced script)
            minimal = causes[f.root_cause].minimal
            assert minimal and (root / minimal).exists(), (sig, why)
    assert causes["ddp-join-static-graph-unused-params-hang"].minimal.endswith("min_ddp_join_static_graph_unused_hang.py")


def _fsdp1_loop_case():
    """FSDP1's own clip, a scheduler and ShardedGradScaler with an overflow at step 1 (test_loop_targets.py's)."""
    return dataclasses.replace(_zero_case(), target="fsdp1", target_options={}, schedule=(Step(),) * 3,
                               optim=Optim("Adam", {"lr": 0.01, "weight_decay": 0.1}), clip=Clip("own", 0.1),
                               lr_scheduler=LRScheduler("StepLR", {"step_size": 1, "gamma": 0.5}),
                               scaler=Scaler(init_scale=256.0, growth_interval=1, overflow=(1,)))


def _zero_uneven_case():
    """Uneven inputs under Join: rank 1 runs out after one step (test_planted.py's)."""
    return dataclasses.replace(_zero_case(), schedule=(Step(),) * 3, target_options={"ddp": {}, "uneven": [3, 1]})


# (the planted bug, its case, the finding's verdict, what the failing run must name); each run clean too
NEW_WRITERS = [
    # ShardedGradScaler steps on the overflow: the params go non-finite where the plain scaler skips
    ("loop_sharded_scaler_steps_on_inf.py", _fsdp1_loop_case, _verdict("parity", "param", 1, "layers.0.weight"),
     "step 1 param layers.0.weight: NaN or inf in one run only"),
    # ZeRO's join hook steps the joined rank's partition without its grads: the params rank 1 owns stop training
    ("zero_join_stale_grads.py", _zero_uneven_case, _verdict("parity", "param", 1, "layers.2.weight"),
     "step 1 param layers.2.weight: sharded "),
]


@pytest.mark.parametrize("bug, make, verdict, shown", NEW_WRITERS, ids=["fsdp1_sharded_scaler", "zero_join"])
def test_fsdp1s_loop_and_zeros_join_scripts_show_their_planted_bug_and_pass_without(tmp_path, bug, make, verdict,
                                                                                   shown):
    case = make()
    assert fallback_reason(case, {}, verdict) is None
    src = straight_script(case, "planted", {}, verdict)
    assert src.count("\n") < 150 and ("with Join([ddp" in src) == (case.target == "zero")
    finds_with_and_passes_without(src, bug, "FINDING: the sharded run differs", shown,
                                  "PASS: the sharded run matches the plain one", tmp_path)


def test_zeros_and_fsdp1s_local_resume_are_written_with_the_plain_optimizer():
    """A loading side resumed without the wrapper (``local``): ZeRO's consolidated state and FSDP1's full one
    (re-keyed by rekey_optim_state_dict) loaded into the plain torch.optim optimizer; the kernel's full-state-dict
    config said whole (the optimizer's offloads by default). (Both PASS under torchrun: measured by hand.)"""
    ck = Checkpoint(0, "consolidate", 2, (2,), target_options={"local": True})
    zero = straight_script(dataclasses.replace(_zero_case(), checkpoint=ck))
    local = zero.split("# the loading side")[1]
    assert "ZeroRedundancyOptimizer(" not in local and "opt = torch.optim.Adam(" in local
    assert "opt.load_state_dict(sd[\"optim\"])" in local
    ck = Checkpoint(0, "fsdp1_full", 2, (2,), target_options={"local": True})
    fsdp1 = straight_script(dataclasses.replace(_zero_case(), target="fsdp1", target_options={}, checkpoint=ck))
    saving, local = fsdp1.split("# the loading side")
    assert "FullOptimStateDictConfig(offload_to_cpu=False)" in saving and "model = FSDP(" in saving
    assert "FSDP(" not in local and "FSDP.rekey_optim_state_dict(sd[\"optim\"], OptimStateKeyType.PARAM_ID" in local
    own = dataclasses.replace(_fsdp1_loop_case(), checkpoint=ck)
    assert fallback_reason(own) == "fsdp1 resumed without FSDP (local) with its own clip (torch.nn.utils' on the local model)"


def test_a_parity_finding_after_a_load_is_replayed_on_the_loading_sides_steps():
    """The saving side trains up to its save without recording; the loading side records from the load (the
    loaded state is the anchor of the first step after it) and the plain model replays the finding's step. (Under
    torchrun: PASS on torch as it is, FINDING with skip_weight_decay.py; fsdp1.parity.AdamW.forloop.param's shows
    its recorded numbers; measured by hand.) Where the loading side has fewer ranks, or the loop carries state
    over the load, it falls back, saying so."""
    found = _verdict("parity", "param", 1, "layers.0.weight")
    case = dataclasses.replace(simple_case(2, optim="Adam"), checkpoint=Checkpoint(0, "dcp", 2, (2,)))
    saving, loading = straight_script(case, "", {}, found).split("# the loading side")
    assert "got.append(" not in saving and "after.append(" not in saving and "dcp.save(" in saving
    assert "after = [None] * 1 + [snapshot(model, opt)]" in loading and "k = 1\n" in loading and "got.append(" in loading
    fewer = dataclasses.replace(case, checkpoint=Checkpoint(0, "dcp", 1, (1,)))
    assert fallback_reason(fewer, {}, found) == "a parity finding after a checkpoint load on fewer ranks than the script's"
    sched = dataclasses.replace(case, lr_scheduler=LRScheduler("StepLR", {"step_size": 1}))
    assert fallback_reason(sched, {}, found).endswith("with the loop's state (the scheduler's, the scaler's)")
