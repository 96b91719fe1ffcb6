"""The straight-line repro (fuzzshard/scriptgen.py): a short script built from
the same init, data and bounds as the kernel, which passes on torch as it is
and fails, standalone under torchrun, with a planted bug."""
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from cases import simple_case
from conftest import PLANTED, torchrun
from fuzzshard import repro, targets
from fuzzshard.kernel.model import build_model, make_batch
from fuzzshard.kernel.plain import sensitivity
from fuzzshard.kernel.reference import reduction_length, reduction_parts, reference_error
from fuzzshard.scriptgen import straight_script
from strategies import cases

# the whole script, and the part above the shared comparison helpers (the case's own), for the drawn
# topologies (up to 4 layers deep, 3 groups, 3 steps); a one-layer case is about 150 and 80
LINES, CASE_LINES = 260, 180
DRAWN = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _defs(src: str) -> dict:
    """The script's definitions, without running it (its main is guarded)."""
    ns = {"__name__": "scriptgen_test"}
    exec(compile(src, "repro.py", "exec"), ns)
    return ns


def _check_drawn(case) -> None:
    src = straight_script(case, "drawn")
    if src is None:
        return
    assert src.count("\n") < LINES and src.index("# ---- comparing") and \
        src[:src.index("# ---- comparing")].count("\n") < CASE_LINES
    assert "import fuzzshard" not in src and "from fuzzshard" not in src
    ns = _defs(src)
    dtype = getattr(torch, case.dtype)
    got, want = ns["build"]().state_dict(), build_model(case.model, case.seed, "cpu", dtype).state_dict()
    assert list(got) == list(want)
    for k in want:  # the same modules built in the same order under the same seed: the kernel's init, bit for bit
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for k in range(len(case.schedule)):
        x, y = ns["batch"](k)
        x0, y0 = make_batch(case.model, case.seed, k, case.batch, case.seq, "cpu", dtype)
        assert torch.equal(x, x0) and torch.equal(y, y0)
    if case.target == "dtensor":
        assert list(ns["PLACEMENTS"]) == [n for n, _ in ns["build"]().named_parameters()]
    assert math.prod(reduction_parts(case)) == reduction_length(case)  # the bound the kernel holds loss and grads to
    model, (x, y) = ns["build"](), ns["batch"](0)  # the one-ulp sensitivity: the kernel's, to the bit
    try:
        theirs = sensitivity(model, dict(model.named_parameters()), x, y, {})
    except RuntimeError:  # nothing to differentiate (no param on the loss's path): the script's raises too
        with pytest.raises(RuntimeError):
            ns["sensitivity"](model, x, y)
        return
    ours = ns["sensitivity"](model, x, y)
    assert ours == {n: v for n, v in theirs.items() if n in ours or v}  # (the kernel's holds 0 for no-grad params)


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
        k, u, sens = [2, 16, 300][i % 3], 2.0 ** -24, [0.0, 1e-9][i % 2]
        extra = torch.rand(3, 4, generator=g, dtype=torch.float64) * 1e-8 if i % 5 == 0 else None
        ours = ns["check"]("x", got, want, (k, u), sens, 0.0 if extra is None else extra)
        theirs = compare("x", 0, "", got, want, {"k_ulps": k, "u": u, "why": ""}, sens=sens, extra=extra)
        assert (ours is None) == (theirs is None), (i, ours, theirs)


@DRAWN
@given(cases(target="dtensor", world_sizes=[1, 2]))
def test_drawn_dtensor_cases_give_a_script_that_builds_the_kernels_model_and_data(case):
    assert (straight_script(case) is None) == (case.checkpoint is not None)  # all but the checkpoint cases
    _check_drawn(case)


@DRAWN
@given(cases(target="fsdp2", world_sizes=[1, 2, 4], checkpoint=False))
def test_drawn_fsdp2_cases_give_a_script_or_none(case):
    plain = set(case.target_options) <= {"wrap", "reshard_after_forward"}
    assert (straight_script(case) is not None) == plain
    _check_drawn(case)


def test_what_the_generator_does_not_write_falls_back_to_the_flattened_kernel():
    case = dataclasses.replace(simple_case(2), target="zero", target_options={"ddp": {}})
    assert straight_script(case) is None
    assert "CASE_JSON" in repro.script(case)
    short, flat = repro.script(simple_case(2)), repro.script(simple_case(2), flat=True)
    assert "CASE_JSON" not in short and "def main():" in short and "CASE_JSON" in flat


def _fsdp2_case():
    return dataclasses.replace(simple_case(2, optim="Adam"), target="fsdp2", batch=4,
                               target_options={"wrap": ["layers.0"], "reshard_after_forward": True})


PLANTED_CASES = [
    # case, (bug file, what the failing run must name: the same divergence the kernel reports)
    # simple_case: two groups with weight decay; layers.0.weight (7, 5) Shard(0) is uneven over 2 ranks
    (simple_case(2), [("skip_weight_decay.py", "step 0 param layers.2.weight"),
                      ("last_shard_untouched.py", "step 0 param layers.0.weight")]),
    (_fsdp2_case(), [("fsdp2_skip_average.py", "step 0 layers.0.weight")]),
]


@pytest.mark.parametrize("case, bugs", PLANTED_CASES, ids=["dtensor", "fsdp2"])
def test_the_script_passes_on_torch_and_fails_standalone_with_a_planted_bug(tmp_path, case, bugs):
    src = straight_script(case, "a planted bug")
    assert src is not None and src.count("\n") < LINES
    script = tmp_path / "repro.py"
    script.write_text(src)
    ok = torchrun(script, case.world_size, cwd=tmp_path)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    for bug, names in bugs:
        buggy = torchrun(script, case.world_size, "--setup", PLANTED / bug, cwd=tmp_path)
        assert buggy.returncode != 0 and "FINDING" in buggy.stdout and names in buggy.stdout, \
            buggy.stdout + buggy.stderr[-2000:]
        assert "max abs err" in buggy.stdout and "allowed" in buggy.stdout  # expected vs actual, and where


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
