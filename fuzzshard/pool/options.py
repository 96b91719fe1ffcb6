"""How a pool's workers run: one typed, frozen record, from the command line down to each worker.

The CLI makes a ``PoolOptions`` of what the user said (cli/common.py,
``pool_options``: --device, --backend, --plugin and --worker-setup,
--case-timeout, --simulate; the pytest plugin of its settings, Options.pool;
a soak hands it to each cell's process whole, session/soak.py SoakOptions);
``Pool(size, options=...)``, the only way to say them, completes it with
what the pool decides (its log folder, the collective timeout, whether cases
are placed side by side, the zygote) as ``Pool.options``, and each worker gets
it as JSON in its environment (``to_worker``). Anyone who needs a pool like
another (the real-process check of a simulated finding, session/simulate.py CheckPools)
derives one from it with ``dataclasses.replace`` or ``simulated(on)``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

CASE_TIMEOUT = 120.0  # seconds: the case timeout unless one is given (--case-timeout, --fuzzshard-case-timeout)


@dataclass(frozen=True)
class PoolOptions:
    device: str = "cpu"
    # the process group backend; None: gloo on CPU, nccl on CUDA ("fake" in a simulated pool: Pool resolves it)
    backend: str | None = None
    setup: tuple[str, ...] = ()  # files run in every worker before any case: --plugin ones, then --worker-setup
    case_timeout: float = CASE_TIMEOUT  # seconds: a case still running after this is a hang
    simulate: bool = False  # each worker runs a whole case alone, every rank (kernel/simulated.py)
    # -- what the pool decides (Pool.__init__ fills them in) ----------------------------------------------
    placed: bool = False  # subgroups for cases placed at any offset, so run_many runs them side by side
    device_offset: int = 0  # rank r uses accelerator (offset + r) % count
    log_dir: str | None = None
    collective_timeout: float | None = None  # a collective stuck past this raises inside the worker
    zygote: bool = True  # workers forked from a process that has imported torch (zygote.py)

    def __post_init__(self):
        object.__setattr__(self, "setup", tuple(os.path.abspath(p) for p in self.setup))

    @property
    def mesh_device(self) -> str:
        return self.device

    def simulated(self, on: bool = True) -> PoolOptions:
        """The same options for a simulated pool (``on``) or one of real process groups."""
        return dataclasses.replace(self, simulate=on, backend=None if self.backend == "fake" else self.backend)

    def to_json(self) -> dict:
        """Plain JSON; ``PoolOptions(**it)`` is the same options (a soak's cell process reads them so)."""
        return {**dataclasses.asdict(self), "setup": list(self.setup)}

    def to_worker(self) -> dict:
        """What a worker reads (pool/worker.py): plain JSON."""
        return {**self.to_json(), "mesh_device": self.mesh_device}
