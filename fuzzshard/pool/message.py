"""Everything the driver and a rank say to each other, as data (the Case itself
crosses as JSON: case.py). Pickled over the pool's connections, each message
sent as itself: a rank says Ready, then answers each RunCase with a CaseDone,
until the driver says Exit."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..verdict import Verdict


@dataclass(frozen=True)
class Ready:
    """A rank's first word, once its process group is up: which rank it is, and what it runs on (torch,
    the targets it knows; on CUDA the device, CUDA and NCCL)."""
    rank: int
    info: dict


@dataclass(frozen=True)
class RunCase:
    """The driver's order to each rank of a case's block: run ``case_json``."""
    case_json: str
    offset: int  # the block's first rank: the case's rank 0, its reporter
    localize: bool = False  # trace module outputs to name the module behind a divergence (kernel/localize.py)
    ckpt_dir: str | None = None  # an empty directory every rank sees, for a case with a checkpoint
    bare: bool = False  # bench's floor: the sharded training alone, nothing observed (kernel/run.run_bare)


@dataclass(frozen=True)
class CaseDone:
    """A rank's answer: the verdict (the kernel's dict, typed; None on a rank that does not report) and seconds per part."""
    verdict: Verdict | None
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Exit:
    """The driver's last word: the rank leaves its process group and exits."""
