"""Durations as people write them: 90s, 10m, 8h, 1d, a bare number of seconds.

The one reader of them: the CLI's flags (cli/common.py's ``parse_duration``
says a bad one as a usage error), the pytest plugin's options and their ini
twins, and the hunt benchmark's cap. Standard library only.
"""
from __future__ import annotations

import re

_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text, flag: str = "") -> float:
    """``text`` (90s, 10m, 8h, 1d; a bare number is seconds) in seconds; a ValueError, naming ``flag``, where
    it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ValueError(f"{flag + ': ' if flag else ''}cannot read duration {text!r}: use e.g. 90s, 10m, 8h")
    return float(m.group(1)) * _UNIT[m.group(2)]
