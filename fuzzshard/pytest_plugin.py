"""pytest plugin: the worker pool as a session fixture, and Hypothesis profiles.

    from hypothesis import given
    import fuzzshard.strategies as fst
    from fuzzshard.testing import check

    @given(fst.cases(target="dtensor", world_sizes=[1, 2]))
    def test_dtensor_parity(fuzz_pool, case):
        check(fuzz_pool, case)

It runs as it is, with Hypothesis's defaults: a test that takes ``fuzz_pool``
runs without a deadline unless its settings name one other than the
profile's (a case is a distributed run of seconds; a 200 ms deadline would
turn the first one into ``DeadlineExceeded``). ``--hypothesis-profile fuzzshard-ci``
(20 examples) or ``fuzzshard-soak`` and ``--hypothesis-seed N`` work as usual;
``--fuzzshard-worker-setup FILE`` patches torch in every worker,
``--fuzzshard-world-size N`` sizes the pool (default 4). A new finding fails
the test and writes the same ``<signature>.json`` + ``.py`` a fuzz session
writes, into ``--fuzzshard-out`` (default ``fuzzshard-findings``), smaller as
Hypothesis shrinks it, and the failure names the ``fuzzshard replay`` line.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

_RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture]
# named apart from Hypothesis's own "ci", which it loads by itself wherever $CI is set: taking that name would
# give every @given test of a user's suite 20 examples in their CI, not only the tests that fuzz with fuzzshard
_BASE = settings.get_profile("default")
settings.register_profile("fuzzshard-ci", _BASE, max_examples=20, deadline=None, suppress_health_check=_RELAXED,
                          print_blob=True)
settings.register_profile("fuzzshard-soak", _BASE, max_examples=100_000, deadline=None,
                          suppress_health_check=_RELAXED, print_blob=True)


def pytest_addoption(parser):
    group = parser.getgroup("fuzzshard")
    group.addoption("--fuzzshard-world-size", type=int, default=4, help="ranks in the session's worker pool")
    group.addoption("--fuzzshard-worker-setup", default=None, help="Python file run in every worker first")
    group.addoption("--fuzzshard-plugin", action="append", default=[],
                    help="your own optimizer from one file (fuzzshard.plugin.optimizer), drawn beside torch.optim's")
    group.addoption("--fuzzshard-device", default="cpu", choices=["cpu", "cuda"])
    group.addoption("--fuzzshard-case-timeout", type=float, default=120.0)
    group.addoption("--fuzzshard-out", default="fuzzshard-findings",
                    help="where a failing example's <signature>.json + .py go (default: fuzzshard-findings)")


def pytest_configure(config):
    from . import testing

    testing.OUT_DIR = config.getoption("--fuzzshard-out", "fuzzshard-findings")


def pytest_collection_modifyitems(items):
    """No deadline for Hypothesis tests that take the pool, unless they set their own."""
    for item in items:
        test = getattr(item, "obj", None)
        if "fuzz_pool" not in getattr(item, "fixturenames", ()) or not getattr(test, "is_hypothesis_test", False):
            continue
        own = test._hypothesis_internal_use_settings
        if own.deadline is not None and own.deadline == settings.default.deadline:
            test._hypothesis_internal_use_settings = settings(own, deadline=None)


@pytest.fixture(scope="session")
def fuzz_pool(request):
    """One pool of workers for the whole test session (spawned once)."""
    from .pool.runner import Pool

    from .pool.worker import run_setup_file

    opt = request.config.getoption
    setups = opt("--fuzzshard-plugin") + [p for p in [opt("--fuzzshard-worker-setup")] if p]
    for path in opt("--fuzzshard-plugin"):
        run_setup_file(path)  # here too: the strategies draw the plugin's optimizer
    pool = Pool(opt("--fuzzshard-world-size"), device=opt("--fuzzshard-device"),
                worker_setup=setups, case_timeout=opt("--fuzzshard-case-timeout"))
    pool.start()
    yield pool
    pool.close()
