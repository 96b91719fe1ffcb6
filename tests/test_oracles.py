"""The comparison, tolerance and signature logic on its own (no processes)."""
import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.findings.record import message_digest, signature
from fuzzshard.verdict import ErrorRecord, Mismatch, Verdict
from fuzzshard.kernel.oracles import (SCALAR_STATE, UNIT_ROUNDOFF, compare, compare_hparams,
                                      compiled_scalar_state_tolerance, compiled_state_allowance, compiled_step_allowance,
                                      compiled_step_tolerance, reduction_tolerance, step_tolerance)


def test_step_tolerance_allows_rounding_and_rejects_real_differences():
    tol = step_tolerance("float32")
    want = torch.randn(100)
    assert compare("param", 0, "w", want.clone(), want, tol) is None
    nudged = torch.nextafter(want, torch.full_like(want, float("inf")))  # one ulp everywhere
    assert compare("param", 0, "w", nudged, want, tol) is None
    bad = want.clone()
    bad[7] += 1e-3
    m = compare("param", 0, "w", bad, want, tol)
    assert m is not None and m["at"] == (7,) and m["bad"] == 1 and "16 ulps of float32" in m["tolerance"]


def test_compiled_step_bound_covers_float32_bias_corrections_and_no_more():
    """A compiled Adam step computes 1 - beta^t in float32 tensors where eager
    uses Python doubles. Emulated here, without compiling: at t = 1 with
    beta2 = 0.999 the update differs by far more than the 16-ulp elementwise
    bound, and within the derived allowance; a wrong update is still caught."""
    torch.manual_seed(0)
    p = torch.randn(1000)
    m, v = torch.randn(1000) * 0.1, torch.rand(1000) * 0.01
    lr, (b1, b2), eps, t = 1.0, (0.9, 0.999), 1e-8, 1

    def update(bc1, bc2):
        return p - lr / bc1 * m / (v.sqrt() / bc2 ** 0.5 + eps)

    eager = update(1 - b1 ** t, 1 - b2 ** t)  # Python doubles
    step = torch.tensor(float(t))
    f32 = update(1 - torch.tensor(b1) ** step, 1 - torch.tensor(b2) ** step)  # float32 tensors, as compiled
    plain = step_tolerance("float32")
    assert compare("param", 0, "w", f32, eager, plain) is not None  # the elementwise bound alone: a false positive
    tol = compiled_step_tolerance(plain, "float32", (b1, b2))
    extra = tol["update_rel"] * (eager - p).abs()
    assert compare("param", 0, "w", f32, eager, tol, extra=extra) is None
    assert "compiled step" in tol["why"]
    wrong = update(1 - b1 ** t, 1 - b2 ** (t + 1))  # a bias correction one step off
    assert compare("param", 0, "w", wrong, eager, tol, extra=extra) is not None


# the strategies' ranges (strategies/optimizers.py) of the optimizers whose compiled
# step computes scalar factors from ``step``
_LRS, _WDS, _EPS = [1e-3, 1e-2, 1e-1, 3e-4, 0.5], [0.0, 0.01, 0.1, 0.5], [1e-8, 1e-6, 1e-3]
_B1, _B2 = [0.9, 0.0, 0.5, 0.99], [0.999, 0.9, 0.99, 0.9999]
_GRID = {
    "Adam": lambda c: dict(lr=c(_LRS), betas=(c(_B1), c(_B2)), eps=c(_EPS), weight_decay=c(_WDS),
                           amsgrad=c([False, True]), decoupled_weight_decay=c([False, True])),
    "Adagrad": lambda c: dict(lr=c(_LRS), lr_decay=c([0.0, 0.01]), weight_decay=c(_WDS),
                              initial_accumulator_value=c([0.0, 0.1]), eps=c([1e-10, 1e-6])),
    "Adamax": lambda c: dict(lr=c(_LRS), betas=(c(_B1), c(_B2)), eps=c(_EPS), weight_decay=c(_WDS)),
    "NAdam": lambda c: dict(lr=c(_LRS), betas=(c(_B1), c(_B2)), eps=c(_EPS), weight_decay=c(_WDS),
                            momentum_decay=c([0.004, 0.05]), decoupled_weight_decay=c([False, True])),
    "ASGD": lambda c: dict(lr=c(_LRS), lambd=c([1e-4, 1e-2]), alpha=c([0.75, 0.5]), t0=c([1e6, 1.0]),
                           weight_decay=c(_WDS)),
}


def _float64_step(name, kw, p0, state, grad, float32_scalars=False, monkeypatch=None):
    """One step of ``name`` on a float64 param from ``state``; ``float32_scalars``:
    the compiled step's scalar math, run eagerly: with ``torch.compiler.is_compiling``
    true, ``optimizer._get_value(step)`` returns the float32 ``step`` tensor itself,
    as it does while Dynamo traces, so every scalar derived from it is float32.
    Emulated on the for-loop path (the foreach one hands Dynamo lists of 0-dim
    tensors as scalars, which eager foreach ops refuse; its scalars are the same
    float32 ones), except ASGD's, whose foreach step multiplies by the eta tensor."""
    p = p0.clone()
    if float32_scalars and name != "ASGD":
        kw = {**kw, "foreach": False}
    opt = getattr(torch.optim, name)([p], **kw)
    opt.state[p] = {k: v.clone() for k, v in state.items()}
    p.grad = grad.clone()
    if float32_scalars:
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            opt.step()
    else:
        opt.step()
    return p.detach(), opt.param_groups[0], opt.state[p]


def _random_state(name, kw, seed, steps):
    torch.manual_seed(seed)
    p = torch.randn(24, 8, dtype=torch.float64)
    opt = getattr(torch.optim, name)([p], **kw)
    for _ in range(steps):  # eager steps from random grads of random scales: a realistic state at step t
        p.grad = torch.randn_like(p) * 10 ** (torch.rand(()).item() * 4 - 3)
        opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()} if steps else {}
    return p.detach().clone(), state, torch.randn_like(p) * 10 ** (torch.rand(()).item() * 4 - 3)


def test_compiled_step_bound_covers_float64_params_with_float32_scalars(monkeypatch):
    """A compiled step of a float64 param computes its scalar factors (bias
    corrections, Adagrad's clr, NAdam's mu, ASGD's eta) in the float32 of the
    ``step`` tensor (optimizer._get_scalar_dtype) where eager uses doubles:
    hundreds of random states and hyperparameters of every such optimizer, the
    compiled path's scalar math run eagerly against eager. The float64
    elementwise bound alone fails nearly all of them (the issue-26 findings);
    the bound derived with float32's u covers all, each float64 state tensor
    still to 16 float64 ulps."""
    import random

    rng = random.Random(0)
    plain = step_tolerance("float64")
    false_positives = n = 0
    for i in range(300):
        name = list(_GRID)[i % len(_GRID)]
        kw = {**_GRID[name](rng.choice), "foreach": rng.choice([False, True])}
        p0, state, grad = _random_state(name, kw, i, rng.choice([0, 1, 2]))
        want, group, want_state = _float64_step(name, kw, p0, state, grad)
        got, _, got_state = _float64_step(name, kw, p0, state, grad, True, monkeypatch)
        tol = compiled_step_tolerance(plain, "float64", kw.get("betas", ()), "float32")
        extra = compiled_step_allowance(tol, name, group, (want - p0).abs(), p0, grad, want_state)
        assert compare("param", 0, "w", got, want, tol, extra=extra) is None, (name, kw)
        false_positives += compare("param", 0, "w", got, want, plain) is not None
        n += 1
        for key, w in want_state.items():
            key_tol = compiled_scalar_state_tolerance(tol) if key in SCALAR_STATE else tol
            more = compiled_state_allowance(name, group, key, extra)
            assert compare(f"state.{key}", 0, "w", got_state[key], w, key_tol, extra=more) is None, (name, kw, key)
            if w.dim() and key != "ax":  # a float64 state tensor: its bound is float64's, compiled or not
                assert compare(f"state.{key}", 0, "w", got_state[key], w, plain) is None, (name, kw, key)
    assert false_positives > 0.75 * n  # all but the exact ones (ASGD foreach)


def test_compiled_step_bound_covers_a_real_compiled_float64_step():
    """The emulation above against torch.compile itself (one compile, reused
    from ten states written into the same tensors: new state tensors would
    recompile, and past Dynamo's cache limit run eagerly): Adam(foreach) on
    float64, as the issue's findings."""
    torch.manual_seed(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=True)
    p = torch.randn(24, 8, dtype=torch.float64)
    opt = torch.optim.Adam([p], **kw)
    compiled = torch.compile(lambda: opt.__class__.step(opt), fullgraph=False)
    plain = step_tolerance("float64")
    tol = compiled_step_tolerance(plain, "float64", kw["betas"], "float32")
    try:
        for i in range(10):
            p0, state, grad = _random_state("Adam", kw, i, i % 3)
            if not state:  # a first step: the state Adam starts from
                state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p0), "exp_avg_sq": torch.zeros_like(p0)}
            want, group, want_state = _float64_step("Adam", kw, p0, state, grad)
            with torch.no_grad():
                p.copy_(p0)
                for k, v in state.items():
                    opt.state[p].setdefault(k, v.clone()).copy_(v)
            p.grad = grad.clone()
            compiled()
            extra = compiled_step_allowance(tol, "Adam", group, (want - p0).abs(), p0, grad, want_state)
            assert compare("param", 0, "w", p.detach(), want, tol, extra=extra) is None
            assert compare("param", 0, "w", p.detach(), want, plain) is not None  # 16 float64 ulps alone: false positive
    finally:
        torch._dynamo.reset()


def test_compiled_float64_bound_still_catches_real_errors(monkeypatch):
    """What the float32 scalars may not hide in a float64 case: a bias
    correction one step off (Adam, NAdam), one float32 ulp of the param where
    the update carries no large correction (Adagrad, Adamax with beta1 = 0.5),
    ASGD's eta one step off, one float32 ulp of a float64 state tensor."""
    plain = step_tolerance("float64")

    def allowance(name, kw, p0, grad, want, group, state):
        tol = compiled_step_tolerance(plain, "float64", kw.get("betas", ()), "float32")
        return tol, compiled_step_allowance(tol, name, group, (want - p0).abs(), p0, grad, state)

    u32 = UNIT_ROUNDOFF["float32"]
    for name, kw in [("Adam", dict(lr=1e-2, betas=(0.9, 0.999))), ("NAdam", dict(lr=1e-2, betas=(0.9, 0.999))),
                     ("Adagrad", dict(lr=1e-2, lr_decay=0.01)), ("Adamax", dict(lr=1e-2, betas=(0.5, 0.9))),
                     ("ASGD", dict(lr=0.5, lambd=1e-2, t0=1.0))]:
        p0, state, grad = _random_state(name, kw, 1, 2)
        want, group, want_state = _float64_step(name, kw, p0, state, grad)
        got, _, got_state = _float64_step(name, kw, p0, state, grad, True, monkeypatch)
        tol, extra = allowance(name, kw, p0, grad, want, group, want_state)
        assert compare("param", 0, "w", got, want, tol, extra=extra) is None
        off = {**state, "step": state["step"] + 1}  # the step count one off: every correction
        wrong, _, wrong_state = _float64_step(name, kw, p0, off, grad, True, monkeypatch)
        if name == "ASGD":  # its step count only enters the next eta
            assert compare("state.eta", 0, "w", wrong_state["eta"], want_state["eta"],
                           compiled_scalar_state_tolerance(tol)) is not None
        else:
            assert compare("param", 0, "w", wrong, want, tol, extra=extra) is not None, name
        if name in ("Adagrad", "Adamax"):  # one float32 ulp of the param
            assert compare("param", 0, "w", got + u32 * got.abs(), want, tol, extra=extra) is not None, name
        key = {"Adagrad": "sum", "ASGD": "ax"}.get(name, "exp_avg")
        w = want_state[key]
        if key != "ax":
            assert compare(f"state.{key}", 0, "w", got_state[key] + u32 * w.abs(), w, tol) is not None, name


def test_tolerance_follows_the_dtype():
    want = torch.ones(4, dtype=torch.float64)
    got = want + 1e-9  # far above float64 rounding, far below float32's
    assert compare("p", 0, "", got, want, step_tolerance("float64")) is not None
    assert compare("p", 0, "", got.float(), want.float(), step_tolerance("float32")) is None
    assert UNIT_ROUNDOFF["bfloat16"] > UNIT_ROUNDOFF["float16"] > UNIT_ROUNDOFF["float32"]


def test_measured_sensitivity_widens_the_bound_for_cancelling_results():
    tol = reduction_tolerance("float32", 10)
    want = torch.tensor([1e-9])  # an analytic zero computed with rounding noise
    got = torch.tensor([4e-8])
    assert compare("grad", 0, "b", got, want, tol) is not None
    assert compare("grad", 0, "b", got, want, tol, sens=1e-8) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=6), st.floats(0, 1e-3), st.floats(0, 1e-3),
       st.floats(0, 1e-5), st.sampled_from(["float32", "float64"]))
def test_a_sensitivity_only_widens_the_bound(values, noise, sens, small, dtype):
    """The reference measures a sensitivity (five nudged forward/backward
    passes) only where a loss or grad fails without one: sound only while a
    larger sensitivity never turns a match into a mismatch."""
    want = torch.tensor(values, dtype=getattr(torch, dtype))
    got = want + noise * torch.linspace(-1, 1, len(values), dtype=want.dtype)
    tol = reduction_tolerance(dtype, 10)
    if compare("grad", 0, "w", got, want, tol, sens=small) is None:
        assert compare("grad", 0, "w", got, want, tol, sens=small + sens) is None


def test_presence_shape_nan_and_hparams_mismatches():
    t = torch.zeros(2)
    assert "none" in compare("grad", 0, "w", None, t, step_tolerance("float32"))["detail"]
    assert "shape" in compare("grad", 0, "w", torch.zeros(3), t, step_tolerance("float32"))["detail"]
    assert "NaN" in compare("p", 0, "w", torch.tensor([float("nan")]), torch.tensor([0.0]), step_tolerance("float32"))["detail"]
    assert compare("p", 0, "w", torch.tensor([float("nan")]), torch.tensor([float("nan")]), step_tolerance("float32")) is None
    assert compare_hparams(0, [{"lr": 0.1}], [{"lr": 0.1}]) is None
    assert compare_hparams(0, [{"lr": 0.1}, {"lr": 0.2}], [{"lr": 0.1}, {"lr": 0.1}])["fqn"] == "group 1"


def _case(optim="Adam"):
    model = Model("features", 2, (Layer("linear", 2, 2),))
    return Case("dtensor", 2, (2,), model, Optim(optim), (Group(("layers.0.weight",)),), (Step(),))


def test_signatures_name_the_bug_not_the_case():
    parity = Verdict("finding", "parity", first=Mismatch("state.exp_avg", "x", 0, ""))
    assert signature(_case(), parity) == "dtensor.parity.Adam.forloop.state.exp_avg"
    localized = Verdict("finding", "parity", first=Mismatch("forward", "", 0, "", extra={"module": "Conv1d"}))
    assert signature(_case("SGD"), localized) == "dtensor.parity.forward.Conv1d"
    e1 = Verdict("finding", "error_parity", error=ErrorRecord("RuntimeError", phase="step 0: optimizer.step",
                 message="aten.add_.Tensor: in-place operations that require placement changes are not supported. The input has placement (Shard(dim=1),)"))
    e2 = Verdict("finding", "error_parity", error=ErrorRecord("RuntimeError", phase="step 2: optimizer.step",
                 message="aten.lerp.Scalar: in-place operations that require placement changes are not supported. The input has placement (_NormPartial(2),)"))
    assert signature(_case("Adam"), e1) == signature(_case("SGD"), e2)
    assert message_digest("shape [3, 4] bad") == message_digest("shape [7, 1] bad") != message_digest("another message")


def test_mixed_precision_bound_has_float16s_underflow_floor_and_no_more():
    """A float16 grad of 2e-8 is below float16's smallest normal number (6.1e-5): a rounding there errs by up
    to half the subnormal spacing (3e-8), not by u*|x|, so an underflowed 0 against 1.99e-8 is rounding (a
    false finding of fsdp2's HSDP hunt); an error of the same size on a normal grad still fails."""
    import torch

    from fuzzshard.kernel.oracles import UNDERFLOW, compare, mixed_precision_tolerance

    tol = mixed_precision_tolerance("float16", "float16", world=3, microbatches=2)
    assert tol["eta"] == UNDERFLOW["float16"] == 2.0**-25 and "underflows" in tol["why"]
    assert compare("grad", 0, "w", torch.zeros(1, 1), torch.full((1, 1), 1.99e-8), tol) is None
    assert compare("grad", 0, "w", torch.full((1, 1), 1.0), torch.full((1, 1), 1.0 + 4e-7), tol) is None
    assert compare("grad", 0, "w", torch.full((1, 1), 1.0), torch.full((1, 1), 1.1), tol) is not None
    assert compare("grad", 0, "w", torch.zeros(1, 1), torch.full((1, 1), 1e-5), tol) is not None
    assert mixed_precision_tolerance("bfloat16", "float32", world=2)["eta"] == 2.0**-134


def test_replica_digests_tell_equal_bytes_from_any_change():
    """kernel/gather.py's digests: the same bytes give the same digest (a copy, another tensor object);
    a one-ulp change, two elements swapped, a value scaled, another length or dtype, a None or another
    hyperparameter give another."""
    from fuzzshard.kernel.gather import _digests

    x = torch.randn(7, 5)
    swapped = x.clone()
    swapped[0, 0], swapped[0, 1] = x[0, 1].item(), x[0, 0].item()
    ulp = x.clone()
    ulp[3, 2] = torch.nextafter(x[3, 2], torch.tensor(float("inf")))
    values = [x, x.clone(), swapped, ulp, x * 2, x[:-1], x.double(), None, 0.001, 0.001, 0.002,
              torch.zeros(0), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
    d = _digests(values).tolist()
    assert d[0] == d[1] and d[8] == d[9] and d[12] == d[13]
    assert len({tuple(r) for r in [d[0], d[2], d[3], d[4], d[5], d[6], d[7], d[11], d[12]]}) == 9
    assert d[8] != d[10]


def test_replica_comparison_is_bit_for_bit_and_says_which_ranks_hold_which_copy():
    from fuzzshard.kernel.oracles import compare_replicas

    x = torch.randn(4, 3)
    same = {r: x.clone() for r in range(4)}
    assert compare_replicas("state.exp_avg_sq", 0, "w", same) is None
    # NaN equals NaN, -0.0 equals 0.0: a copy, not a divergence
    nan = torch.tensor([float("nan"), 0.0])
    assert compare_replicas("param", 0, "w", {0: nan, 1: torch.tensor([float("nan"), -0.0])}) is None
    drift = dict(same)
    drift[2] = x.clone()
    drift[2][1, 1] = torch.nextafter(x[1, 1], torch.tensor(float("inf")))  # one ulp: caught
    drift[3] = drift[2].clone()
    m = compare_replicas("state.exp_avg_sq", 1, "w", drift)
    assert m is not None and m["ranks"] == [2, 3] and m["replicas"] == [[0, 1], [2, 3]] and m["at"] == (1, 1)
    assert m["step"] == 1 and "bit for bit" in m["tolerance"] and m["detail"].startswith("rank 2's copy vs rank 0's")
    assert compare_replicas("grad", 0, "w", {0: x, 1: None})["presence"] == "vanished"
    lr = compare_replicas("param_groups.lr", 0, "group 0", {0: 0.01, 1: 0.005, 2: 0.01})
    assert lr["ranks"] == [1] and lr["replicas"] == [[0, 2], [1]]


def test_replica_signature_names_what_diverged():
    from fuzzshard.oracle.replica import ORACLE

    state = Verdict("finding", "replica", first=Mismatch("state.exp_avg_sq", "w", 1, "", extra={"replicas": [[0, 1], [2, 3]]}),
                    extra={"count": 1})
    assert ORACLE.signature(_case(), state) == "dtensor.replica.state.exp_avg_sq"
    loaded = Verdict("finding", "replica", first=Mismatch("loaded.param_groups.lr", "group 0", 0, ""), extra={"count": 1})
    assert ORACLE.signature(_case(), loaded) == "dtensor.replica.loaded.group.lr"
    assert "[0, 1] vs [2, 3]" in ORACLE.summary(state)


def test_a_message_number_in_exponent_form_has_the_decimal_forms_template():
    from fuzzshard.oracle.error_parity import message_digest

    # one ZeRO bug met as "max abs diff 2.89e-06" and "0.00067" was two signatures (a 10-minute session, seed 5)
    assert message_digest("the replicas of a param differ: rank 1 vs rank 0, max abs diff 2.89e-06") == \
        message_digest("the replicas of a param differ: rank 1 vs rank 0, max abs diff 0.00067") == "9a19bd4f"
    assert message_digest("max abs diff 2.89e-06") != message_digest("max abs diff 2.89e-06 at step")
