"""``fuzz --simulate``: a session of world sizes a pool of processes cannot reach, each case's ranks in one process.

Under ``--simulate`` every worker of the pool runs whole cases alone, every
rank of a case at once, under torch's LocalTensorMode: kernel/simulated.py's
``SimulatedWorld``, the kernel's ``World`` seam (kernel/mesh.py) as the real
pool's Meshes is, so kernel/run.py runs unchanged. This module is the
session's side of it: the mode's defaults (world sizes 5-64, a longer case
timeout, a worker per core, the draws it adds; cli/fuzz.py checks the flags
against them), and the session whose book sets LocalTensor's own errors
aside (``SimulatedSession``). Whether a case can run simulated is the world's to say
(kernel/simulated.py, ``cannot_simulate``).

A simulated finding is a finding only once its shrunk case fails the same
way on real gloo process groups: the last step of its life
(findings/life.py, ``confirm_on_real``) checks it after the session, on the
pools this module makes (``CheckPools``: findings/ starts none); one that passes there is a LocalTensor limitation,
written under OUT/simulation_limits/ and never reported as a finding; one too
large for this machine is "simulated only". ``bench --simulate`` is in
session/bench.py. docs/simulate.md says which targets run simulated and why
the others do not.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from ..findings.localtensor import SimulatedBook
from ..kernel.simulated import SIMULATED_TARGETS, THREE_DIM_TARGETS, available  # noqa: F401 (cli/fuzz.py's)
from .engine import Session

DEFAULT_WORLD_SIZES = "5,6,7,8,12,16,32,64"
SIMULATED_CASE_TIMEOUT = 600.0  # --case-timeout's default under --simulate (a 64-rank case: seconds, a minute loaded)


def simulated_draws(names: list[str]) -> dict:
    """What a simulated session of ``names`` draws beside the flags' draws: dims that grow with the world size
    (at 64 ranks, dims of 1-9 would leave most shards empty), and 3-dim meshes where every target takes them."""
    return {"dims_up_to_world": True, **({"mesh_dims": 3} if all(n in THREE_DIM_TARGETS for n in names) else {})}


def simulated_workers() -> int:
    """One simulated case per core, side by side."""
    return max(1, os.cpu_count() or 1)


class SimulatedSession(Session):
    """fuzz --simulate's session: its book (findings/localtensor.py's SimulatedBook) sets LocalTensor's own
    errors aside, unshrunk, for the real-process check at the session's end (``book.set_aside``)."""
    book_class = SimulatedBook  # Session's hook for the book a kind of session keeps (session/engine.py)


class CheckPools:
    """The pools the real-process check of a simulated session's findings runs on (findings/life.py's
    ``confirm_on_real``), made from the session's typed pool options (pool/options.py): ``simulated()``, a
    pool of ``workers`` simulated workers side by side (two where not said), and ``real(n)``, n fresh real
    gloo processes; each started on entering its ``with`` and closed on leaving it."""

    def __init__(self, options, workers: int | None = None):
        self.options = options
        self.workers = workers or max(1, min(2, os.cpu_count() or 1))

    @contextmanager
    def simulated(self):
        with self._started(self.options.simulated(True), self.workers, placed=True) as pool:
            yield pool

    @contextmanager
    def real(self, size: int):
        with self._started(self.options.simulated(False), size) as pool:  # real gloo processes
            yield pool

    @staticmethod
    @contextmanager
    def _started(options, size: int, placed: bool = False):
        from ..pool.runner import Pool

        pool = Pool(size, options=options, placed=placed).start()
        try:
            yield pool
        finally:
            pool.close()
