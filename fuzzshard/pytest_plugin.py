"""pytest plugin: the worker pool as a session fixture, Hypothesis profiles, options and a marker.

    from hypothesis import given
    import fuzzshard.strategies as fst
    from fuzzshard.testing import check

    @given(fst.cases(target="dtensor", world_sizes=[1, 2]))
    def test_dtensor_parity(fuzz_pool, case):
        check(fuzz_pool, case)

It runs as it is, with Hypothesis's defaults: a ``@given`` test that takes ``fuzz_pool`` and has no
``@settings`` of its own runs without a deadline unless the loaded profile sets one (a case is a
distributed run of seconds; a 200 ms deadline would turn the first one into ``DeadlineExceeded``).
A test's own ``@settings`` are left as they are (Hypothesis's rule: explicit settings win); one that
exceeds its deadline gets a line saying how to lift it. ``--hypothesis-profile fuzzshard-ci`` (20
examples) or ``fuzzshard-soak`` and ``--hypothesis-seed N`` work as usual. Every option has an ini
twin (``fuzzshard_world_size = 2`` under ``[pytest]``): the command line wins over ``FUZZSHARD_OUT``
(the findings folder only), that over the ini file, that over the default. Tests that take
``fuzz_pool`` carry the ``fuzzshard`` marker (``-m "not fuzzshard"`` leaves them out). A new
finding fails the test and writes the same ``<signature>.json`` + ``.py`` a fuzz session writes,
smaller as Hypothesis shrinks it, and the failure names the ``fuzzshard replay`` line
(docs/pytest.md).

Nothing here imports torch: the plugin loads in every pytest of an environment fuzzshard is in.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

from .duration import parse_duration
from .pool.options import CASE_TIMEOUT

try:
    from hypothesis import is_hypothesis_test
except ImportError:  # a Hypothesis from before it was exported
    from hypothesis.internal.detection import is_hypothesis_test

_RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture]
# named apart from Hypothesis's own "ci", which it loads by itself wherever $CI is set: taking that name would
# give every @given test of a user's suite 20 examples in their CI, not only the tests that fuzz with fuzzshard
_BASE = settings.get_profile("default")
settings.register_profile("fuzzshard-ci", _BASE, max_examples=20, deadline=None, suppress_health_check=_RELAXED,
                          print_blob=True)
settings.register_profile("fuzzshard-soak", _BASE, max_examples=100_000, deadline=None,
                          suppress_health_check=_RELAXED, print_blob=True)

MARKER = "fuzzshard"
OUT_ENV = "FUZZSHARD_OUT"
DEVICES = ("cpu", "cuda")
DEFAULTS = {"world_size": 4, "device": "cpu", "case_timeout": CASE_TIMEOUT, "out": "fuzzshard-findings"}

# (option, ini name, metavar, help): the one list --help, the ini file and options() read
_OPTIONS = [
    ("--fuzzshard-world-size", "fuzzshard_world_size", "N",
     "ranks in the session's worker pool: the largest world size a case may draw (default 4)"),
    ("--fuzzshard-worker-setup", "fuzzshard_worker_setup", "FILE.py",
     "a Python file every worker runs first (patch torch, register a target)"),
    ("--fuzzshard-plugin", "fuzzshard_plugin", "FILE.py",
     "your own optimizer, model or parallelism from one file (fuzzshard.plugin), drawn beside torch's; "
     "may be given more than once"),
    ("--fuzzshard-device", "fuzzshard_device", "{cpu,cuda}",
     "where the worker ranks run: cpu (gloo) or cuda (NCCL, one GPU per rank) (default cpu)"),
    ("--fuzzshard-case-timeout", "fuzzshard_case_timeout", "DURATION",
     f"a case still running after this long is a hang: seconds, or 90s, 2m (default {CASE_TIMEOUT:g}s)"),
    ("--fuzzshard-out", "fuzzshard_out", "DIR",
     f"where a failing example's <signature>.json + .py go (default: ${OUT_ENV}, else fuzzshard-findings)"),
]


def _ini_help(flag: str, text: str) -> str:
    if flag == "--fuzzshard-plugin":
        text = text.replace("may be given more than once", "one file or more, one a line")
    if flag == "--fuzzshard-out":
        return (f"where a failing example's <signature>.json + .py go, relative to the ini file "
                f"({flag} and ${OUT_ENV} win; default fuzzshard-findings)")
    if flag in ("--fuzzshard-worker-setup", "--fuzzshard-plugin"):
        text += ", relative to the ini file"
    return f"{text} ({flag} wins)"


def _seconds(text) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError(f"cannot read duration {text!r}: use e.g. 120, 90s or 2m")
    return seconds


def pytest_addoption(parser):
    group = parser.getgroup("fuzzshard", "fuzzshard: fuzz sessions as tests, on the fuzz_pool fixture's workers "
                                         "(each option has an ini twin: fuzzshard_world_size, ...)")
    for flag, ini, metavar, text in _OPTIONS:
        kw = {"action": "append", "default": []} if flag == "--fuzzshard-plugin" else {"default": None}
        group.addoption(flag, dest=ini, metavar=metavar, help=text, **kw)
        # ini values are read as text (every pytest since 7 has "string"; paths resolved below, from the ini's folder)
        parser.addini(ini, _ini_help(flag, text),
                      type="linelist" if flag == "--fuzzshard-plugin" else "string", default=None)


@dataclass(frozen=True)
class Options:
    """The plugin's settings as one test session resolved them (options(config))."""
    world_size: int = DEFAULTS["world_size"]
    worker_setup: str | None = None
    plugins: tuple[str, ...] = ()
    device: str = DEFAULTS["device"]
    case_timeout: float = DEFAULTS["case_timeout"]
    out: str = DEFAULTS["out"]
    source: dict = field(default_factory=dict, compare=False)  # where each came from: the flag, the ini, $FUZZSHARD_OUT or "default"

    def pool(self):
        """The pool's options (pool/options.py), as the CLI makes them of the same flags: the plugins, then
        the worker setup, run in every worker."""
        from .pool.options import PoolOptions

        return PoolOptions(device=self.device, setup=(*self.plugins, *[p for p in [self.worker_setup] if p]),
                           case_timeout=self.case_timeout)


def options(config) -> Options:
    """Each setting from the command line, else (``out`` only) $FUZZSHARD_OUT, else the ini file, else the
    default. A path from the ini file is relative to that file's folder; a bad value is a one-line usage error."""
    base = config.inipath.parent if getattr(config, "inipath", None) else config.rootpath
    got, source = {}, {}
    for flag, ini, _, _ in _OPTIONS:
        key = ini.removeprefix("fuzzshard_")
        cli, from_ini = config.getoption(ini), config.getini(ini)
        if cli not in (None, []):
            got[key], source[key] = cli, flag
        elif key == "out" and os.environ.get(OUT_ENV):
            got[key], source[key] = os.environ[OUT_ENV], f"${OUT_ENV}"
        elif from_ini not in (None, [], ""):
            if key in ("worker_setup", "out"):
                from_ini = str(base / from_ini)
            elif key == "plugin":
                from_ini = [str(base / line) for line in from_ini if line.strip()]
            got[key], source[key] = from_ini, f"{ini} in {config.inipath}"
        else:
            source[key] = "default"
    for key, read in (("world_size", _rank_count), ("case_timeout", _seconds), ("device", _device)):
        if key in got:
            try:
                got[key] = read(got[key])
            except ValueError as e:
                raise pytest.UsageError(f"fuzzshard: {source[key]}: {e}") from None
    if "plugin" in got:
        got["plugins"] = tuple(got.pop("plugin"))
    return Options(**got, source=source)


def _rank_count(text) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"takes a number of ranks, got {text!r}") from None
    if n < 1:
        raise ValueError(f"a pool needs at least one rank, got {n}")
    return n


def _device(text) -> str:
    if text not in DEVICES:
        raise ValueError(f"takes one of {', '.join(DEVICES)}, got {text!r}")
    return text


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARKER}: a test that runs cases on fuzzshard's worker pool (the fuzz_pool fixture); added to "
                   "every test that takes it, so -m 'not fuzzshard' leaves them out")
    options(config)  # a bad value is a usage error now, not at the first test that takes the pool


def _deadline_set_by_user() -> bool:
    """Whether the loaded profile names a deadline other than Hypothesis's built-in one."""
    return settings.default.deadline != settings.get_profile("default").deadline


def pytest_collection_modifyitems(config, items):
    """Tests that take the pool get the marker; those with no @settings of their own and no deadline in the
    loaded profile run without a deadline (the profile's other settings kept)."""
    lift = None if _deadline_set_by_user() else settings(parent=settings.default, deadline=None)
    for item in items:
        if "fuzz_pool" not in getattr(item, "fixturenames", ()):
            continue
        item.add_marker(MARKER)
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        if lift is None or test is None or not is_hypothesis_test(test):
            continue
        try:
            lift(test)  # Hypothesis's decorator: refused where the test has @settings of its own
        except InvalidArgument:
            pass  # the user's settings, as they are


_HINT = ("fuzzshard: this test takes fuzz_pool and ran under a deadline (its own @settings' or the loaded "
         "profile's); a case is a distributed run of seconds: set deadline=None there, or a deadline the cases "
         "fit in (docs/pytest.md)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.failed and call.excinfo is not None and "fuzz_pool" in getattr(item, "fixturenames", ())
            and "DeadlineExceeded" in report.longreprtext):
        report.sections.append(("fuzzshard", _HINT))


@pytest.fixture(scope="session")
def fuzz_pool(request):
    """One pool of workers for the whole test session (spawned once)."""
    from . import testing
    from .pool.runner import Pool
    from .pool.worker import run_setup_file

    opts = options(request.config)
    testing.OUT_DIR = opts.out
    for path in opts.plugins:
        run_setup_file(path)  # here too: the strategies draw the plugin's optimizer
    pool = Pool(opts.world_size, options=opts.pool())
    pool.start()
    yield pool
    pool.close()
