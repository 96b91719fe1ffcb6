"""Which torch releases fuzzshard runs on, and every difference between them
that fuzzshard's own code has to know: one place, so a new release's change is
one function here and not a check scattered through the kernel.

The range is measured, not guessed (docs/versions.md): a clean session per
target and ``fuzzshard known --check`` on each release in ``TESTED``. Below
``FLOOR`` the CLI refuses to start, with one line naming the floor.

Standard library only at the top (torch is imported inside the functions):
the kernel imports this module, so it is flattened into repro scripts too.
"""
from __future__ import annotations

import re

FLOOR = (2, 9)  # the oldest release fuzzshard supports (docs/versions.md says why)
# the releases a clean session per target and `known --check` were run on (docs/versions.md, known/README.md)
TESTED = ("2.9.0", "2.9.1", "2.10.0", "2.13.0", "2.14.1", "2.15.0")  # 2.15.0, 2.9.1: docs/versions.md, bisect


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13), "2.16.0.dev20260101" -> (2, 16)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def installed_torch() -> str | None:
    """The installed torch's version without importing it (the CLI's start stays fast), None if none."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        try:
            import torch
        except ImportError:
            return None
        return torch.__version__


def too_old(version: str | None = None) -> str | None:
    """One line saying why this torch cannot run fuzzshard (below the floor, or none), None when it can."""
    version = installed_torch() if version is None else version
    floor = ".".join(map(str, FLOOR))
    if version is None:
        return f"torch is not installed; fuzzshard needs torch>={floor}"
    if release(version) < FLOOR:
        return f"torch {version} is older than fuzzshard's floor, torch {floor} (pip install 'torch>={floor}')"
    return None


# ---- API differences between releases -------------------------------------

def shard_size_and_offset(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(length, offset) of chunk ``index`` of a dim of ``size`` split as Shard splits it over ``chunks``
    ranks: ``Shard.local_shard_size_and_offset`` from 2.9 on, the private ``_local_shard_size_and_offset``
    (same arguments and result) in 2.8."""
    from torch.distributed.tensor import Shard

    f = getattr(Shard, "local_shard_size_and_offset", None) or Shard._local_shard_size_and_offset
    return tuple(f(size, chunks, index))
