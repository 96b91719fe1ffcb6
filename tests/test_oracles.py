"""The comparison, tolerance and signature logic on its own (no processes)."""
import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from fuzzshard.case import Case, Group, Layer, Model, Optim, Step
from fuzzshard.findings import _digest, signature
from fuzzshard.kernel.oracles import (UNIT_ROUNDOFF, compare, compare_hparams, compiled_step_tolerance, reduction_tolerance,
                                      step_tolerance)


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
    parity = {"status": "finding", "oracle": "parity", "first": {"quantity": "state.exp_avg", "step": 0, "fqn": "x"}}
    assert signature(_case(), parity) == "dtensor.parity.Adam.forloop.state.exp_avg"
    localized = {"status": "finding", "oracle": "parity", "first": {"quantity": "forward", "module": "Conv1d", "step": 0}}
    assert signature(_case("SGD"), localized) == "dtensor.parity.forward.Conv1d"
    e1 = {"oracle": "error_parity", "error": {"type": "RuntimeError", "phase": "step 0: optimizer.step",
          "message": "aten.add_.Tensor: in-place operations that require placement changes are not supported. The input has placement (Shard(dim=1),)"}}
    e2 = {"oracle": "error_parity", "error": {"type": "RuntimeError", "phase": "step 2: optimizer.step",
          "message": "aten.lerp.Scalar: in-place operations that require placement changes are not supported. The input has placement (_NormPartial(2),)"}}
    assert signature(_case("Adam"), e1) == signature(_case("SGD"), e2)
    assert _digest("shape [3, 4] bad") == _digest("shape [7, 1] bad") != _digest("another message")
