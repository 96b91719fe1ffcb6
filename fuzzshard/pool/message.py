"""What the driver and a rank say to each other about a case, as data (the Case
itself crosses as JSON: case.py). Pickled over the pool's connections."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    """A rank's answer: the verdict (a dict, the kernel's; None on a rank that does not report) and seconds per part."""
    verdict: dict | None
    timings: dict = field(default_factory=dict)
