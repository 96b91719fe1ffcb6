"""The pytest plugin as a user meets it: a plain @given test that takes
fuzz_pool, Hypothesis's defaults (no profile), in a pytest of its own; its
options (--help, the ini file, $FUZZSHARD_OUT), marker and deadline."""
import json
import os
import re
import subprocess
import sys
import textwrap

from conftest import PLANTED, run_cli

USER_TEST = textwrap.dedent('''
    from hypothesis import given, settings
    import fuzzshard.strategies as fst
    from fuzzshard.testing import check


    @settings(max_examples={examples}, deadline=None)  # its own @settings: the plugin leaves them as they are
    @given(fst.cases(target="dtensor", world_sizes={worlds}, optimizer_names=["SGD"], checkpoint=False))
    def test_sgd_on_dtensor(fuzz_pool, case):
        check(fuzz_pool, case)
''')


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


# The plugin's options, marker and deadline, in pytests of their own that start no workers: the conftest stands
# in for the pool (a test's fixture wins over a plugin's), so each run takes about a second
FAKE_POOL_CONFTEST = """
import pytest
from hypothesis import Phase, settings

settings.register_profile("mine", max_examples=2, phases=[Phase.generate], database=None)  # no deadline named
settings.register_profile("mine-deadline", settings.get_profile("mine"), deadline=100)


@pytest.fixture(scope="session")
def fuzz_pool():
    return "a stand-in: these tests are about settings, not cases"


def pytest_collection_finish(session):
    marked = sorted(i.name for i in session.items if i.get_closest_marker("fuzzshard"))
    open("marked.json", "w").write(__import__("json").dumps(marked))
"""

SLOW_TESTS = textwrap.dedent("""
    import dataclasses, json, time
    from hypothesis import given, settings, strategies as st


    @given(st.integers())
    def test_bare(fuzz_pool, x):  # no @settings: the plugin lifts the deadline unless the profile names one
        time.sleep(0.3)


    @settings(max_examples=2)
    @given(st.integers())
    def test_own_settings(fuzz_pool, x):  # the user's own settings, as they are: the profile's 200 ms deadline
        time.sleep(0.3)


    @given(st.integers())
    def test_no_pool(x):  # not a fuzz test: Hypothesis's deadline, untouched
        time.sleep(0.3)


    def test_options(pytestconfig):
        from fuzzshard.pytest_plugin import options

        opts = dataclasses.asdict(options(pytestconfig))
        open("options.json", "w").write(json.dumps(opts))
""")

INI = """[pytest]
fuzzshard_world_size = 3
fuzzshard_case_timeout = 90s
fuzzshard_out = from-ini
fuzzshard_worker_setup = setup.py
fuzzshard_plugin =
    a.py
    b.py
"""


def _fake_pool_pytest(tmp_path, *args, env_out=None):
    (tmp_path / "conftest.py").write_text(FAKE_POOL_CONFTEST)
    (tmp_path / "test_settings.py").write_text(SLOW_TESTS)
    (tmp_path / "pytest.ini").write_text(INI)
    env = {k: v for k, v in os.environ.items() if k not in ("FUZZSHARD_OUT", "PYTEST_ADDOPTS", "CI")}
    if env_out:
        env["FUZZSHARD_OUT"] = env_out
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", "-rA", *args]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    found = re.findall(r"^(PASSED|FAILED|ERROR) test_settings\.py::(\w+)", r.stdout, re.M)
    return r, {name: outcome for outcome, name in found}


def test_pytest_help_shows_the_fuzzshard_group_with_every_option_and_ini_option_described(tmp_path):
    from fuzzshard.pytest_plugin import _OPTIONS

    r = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    group = re.search(r"^fuzzshard: (\S.*):\n((?:  .*\n)+)", r.stdout, re.M)
    assert group, r.stdout[-3000:]
    # each option followed by its help: text on its own line, or after the metavar on the option's line
    described = dict(re.findall(r"^  (--fuzzshard-[\w-]+)=\S+(.*\n(?:\s{20,}.*\n)*)", group.group(2), re.M))
    for flag, ini, _, _ in _OPTIONS:
        assert len(described.get(flag, "").split()) >= 4, f"{flag} has no help in:\n{group.group(2)}"
        assert re.search(rf"^  {ini} \(\w+\):\n\s+\S+ \S+", r.stdout, re.M), f"ini option {ini} has no help"
    assert set(described) == {flag for flag, *_ in _OPTIONS}


def test_the_ini_file_sets_each_option_and_the_command_line_and_fuzzshard_out_win_over_it(tmp_path):
    r, outcomes = _fake_pool_pytest(tmp_path, "--hypothesis-profile", "mine", "--fuzzshard-world-size", "2",
                                    "--fuzzshard-out", "from-cli", env_out="from-env")
    opts = json.loads((tmp_path / "options.json").read_text())
    assert opts["world_size"] == 2 and opts["source"]["world_size"] == "--fuzzshard-world-size"  # command line
    assert opts["out"] == "from-cli"  # the command line over $FUZZSHARD_OUT over the ini file
    assert opts["case_timeout"] == 90.0 and opts["device"] == "cpu"  # the ini file; the default
    assert opts["worker_setup"] == str(tmp_path / "setup.py")  # a path in the ini file: from the ini's folder
    assert opts["plugins"] == [str(tmp_path / "a.py"), str(tmp_path / "b.py")]
    # the marker is registered (--strict-markers) and on the tests that take fuzz_pool, and only on those
    assert json.loads((tmp_path / "marked.json").read_text()) == ["test_bare", "test_own_settings"]
    # the deadline: lifted for the bare @given test that takes the pool, under a profile that names none; a test's
    # own @settings and a test without the pool keep theirs, and the first says how to lift it
    assert outcomes == {"test_bare": "PASSED", "test_own_settings": "FAILED", "test_no_pool": "FAILED",
                        "test_options": "PASSED"}, r.stdout[-3000:]
    assert r.stdout.count("DeadlineExceeded") >= 2 and r.stdout.count("fuzzshard: this test takes fuzz_pool") == 1

    again = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                            "--fuzzshard-case-timeout", "soon"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 4, again.stdout[-2000:] + again.stderr[-2000:]
    assert "fuzzshard: --fuzzshard-case-timeout: cannot read duration 'soon'" in again.stderr, again.stderr[-2000:]


def test_a_deadline_the_users_own_profile_sets_is_respected_and_fuzzshard_out_wins_over_the_ini(tmp_path):
    r, outcomes = _fake_pool_pytest(tmp_path, "--hypothesis-profile", "mine-deadline", "-k", "bare or options",
                                    env_out="from-env")
    assert outcomes == {"test_bare": "FAILED", "test_options": "PASSED"}, r.stdout[-3000:]
    assert "DeadlineExceeded" in r.stdout and "fuzzshard: this test takes fuzz_pool" in r.stdout, r.stdout[-3000:]
    opts = json.loads((tmp_path / "options.json").read_text())
    assert opts["out"] == "from-env" and opts["source"]["out"] == "$FUZZSHARD_OUT"
