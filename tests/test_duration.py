"""One duration reader (fuzzshard/duration.py) behind every flag, ini option and tool that takes one, and one
case-timeout default (pool/options.py) behind every place that defaults it."""
import inspect

import pytest

from fuzzshard import pytest_plugin
from fuzzshard.cli import common
from fuzzshard.duration import parse_duration
from fuzzshard.pool.options import CASE_TIMEOUT, PoolOptions
from fuzzshard.pool.runner import Pool


def test_every_reader_reads_a_duration_alike_and_refuses_the_same_text():
    for text, seconds in [("90", 90.0), ("90s", 90.0), (" 2.5m ", 150.0), ("8h", 28800.0), ("1d", 86400.0)]:
        assert parse_duration(text) == common.parse_duration(text) == pytest_plugin._seconds(text) == seconds
    for bad in ["ten minutes", "-5", "5 min", "", "1e3"]:
        with pytest.raises(ValueError, match=f"--x: cannot read duration {bad!r}"):
            parse_duration(bad, "--x")
        with pytest.raises(common.UsageError, match=f"--x: cannot read duration {bad!r}"):
            common.parse_duration(bad, "--x")
        with pytest.raises(ValueError, match="cannot read duration"):
            pytest_plugin._seconds(bad)
    assert parse_duration("0s") == 0.0  # (a flag that must be positive says so itself)
    with pytest.raises(ValueError, match="cannot read duration '0'"):
        pytest_plugin._seconds("0")


def test_the_case_timeout_default_is_said_once():
    assert CASE_TIMEOUT == PoolOptions().case_timeout == pytest_plugin.DEFAULTS["case_timeout"] == \
        parse_duration(common.CASE_TIMEOUT)
    assert "case_timeout" not in inspect.signature(Pool.__init__).parameters  # a Pool takes it in its PoolOptions
