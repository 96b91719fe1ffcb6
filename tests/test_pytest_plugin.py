"""The pytest plugin as a user meets it: a plain @given test that takes
fuzz_pool, Hypothesis's defaults (no profile), in a pytest of its own."""
import subprocess
import sys

from conftest import PLANTED, run_cli

USER_TEST = '''
from hypothesis import given, settings
import fuzzshard.strategies as fst
from fuzzshard.testing import check


@settings(max_examples={examples})  # the deadline is Hypothesis's default: the plugin lifts it for fuzz_pool
@given(fst.cases(target="dtensor", world_sizes={worlds}, optimizer_names=["SGD"], checkpoint=False))
def test_sgd_on_dtensor(fuzz_pool, case):
    check(fuzz_pool, case)
'''


def _pytest(tmp_path, name: str, examples: int, worlds: list, *args):
    (tmp_path / f"test_{name}.py").write_text(USER_TEST.format(examples=examples, worlds=worlds))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"test_{name}.py",
           "--fuzzshard-world-size", "2", "--fuzzshard-out", str(tmp_path / "found"), *map(str, args)]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_a_plain_given_test_runs_with_hypothesis_defaults_and_a_too_small_pool_says_so(tmp_path):
    too_big = USER_TEST.format(examples=2, worlds=[3]).replace("test_sgd_on_dtensor", "test_too_big")
    (tmp_path / "test_too_big.py").write_text(too_big)  # beside the clean one: one pytest, one pool
    r = _pytest(tmp_path, "clean", 6, [1, 2], "test_too_big.py")
    assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r.stdout[-3000:]
    assert "this case needs 3 ranks and the pool has 2" in r.stdout and "--fuzzshard-world-size 3" in r.stdout
    assert "Traceback" not in r.stdout and "DeadlineExceeded" not in r.stdout, r.stdout[-3000:]


def test_a_failing_example_writes_the_finding_files_and_names_the_replay(tmp_path):
    r = _pytest(tmp_path, "planted", 40, [1], "--fuzzshard-worker-setup", PLANTED / "skip_weight_decay.py")
    assert r.returncode == 1, r.stdout[-3000:]
    found = sorted((tmp_path / "found").glob("dtensor.parity.SGD.*.json"))
    assert found and found[0].with_suffix(".py").exists(), r.stdout[-3000:]
    assert f"replay: fuzzshard replay {found[0]}" in r.stdout, r.stdout[-3000:]
    again = run_cli("replay", found[0], setup="skip_weight_decay.py")  # the smallest example, as itself
    assert again.returncode == 1 and f"FAIL: {found[0].stem}" in again.stdout, again.stdout + again.stderr[-2000:]


def test_the_plugins_profiles_leave_hypothesis_own_ci_profile_alone():
    """Hypothesis loads its "ci" profile by itself wherever $CI is set: the plugin (loaded into every pytest of
    an environment fuzzshard is installed in) must not change what that gives a user's other tests."""
    from hypothesis import settings

    import fuzzshard.pytest_plugin  # noqa: F401  (pytest loaded it already; the import says what is tested)

    assert settings.get_profile("ci").max_examples == settings.get_profile("default").max_examples
    assert settings.get_profile("ci").derandomize is True  # Hypothesis's own
    assert settings.get_profile("fuzzshard-ci").max_examples == 20
    assert settings.get_profile("fuzzshard-ci").deadline is None
    assert settings.get_profile("fuzzshard-soak").max_examples == 100_000
