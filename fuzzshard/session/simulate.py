"""``fuzz --simulate``: a session of world sizes a pool of processes cannot reach, each case's ranks in one process.

Under ``--simulate`` every worker of the pool runs whole cases alone, every
rank of a case at once, under torch's LocalTensorMode: kernel/simulated.py's
``SimulatedWorld``, the kernel's ``World`` seam (kernel/mesh.py) as the real
pool's Meshes is, so kernel/run.py runs unchanged. This module is the
session's side of it: the command's checks and defaults (``simulate_args``:
world sizes 5-64, no checkpoints, a longer case timeout, a worker per core),
and the session whose book sets LocalTensor's own errors aside
(``SimulatedSession``). Whether a case can run simulated is the world's to say
(kernel/simulated.py, ``cannot_simulate``).

A simulated finding is a finding only once its shrunk case fails the same
way on real gloo process groups: findings/simulated.py (``confirm``) checks
it after the session; one that passes there is a LocalTensor limitation,
written under OUT/simulation_limits/ and never reported as a finding; one too
large for this machine is "simulated only". ``bench --simulate`` is in
session/bench.py. docs/simulate.md says which targets run simulated and why
the others do not.
"""
from __future__ import annotations

import os
import sys

from ..findings.simulated import SimulatedBook
from ..kernel.simulated import SIMULATED_TARGETS, THREE_DIM_TARGETS, available
from .engine import Session

DEFAULT_WORLD_SIZES = "5,6,7,8,12,16,32,64"
SIMULATED_CASE_TIMEOUT = 600.0  # --case-timeout's default under --simulate (a 64-rank case: seconds, a minute loaded)


def simulate_args(args) -> None:
    """``fuzz --simulate``: its checks and defaults, into ``args`` (a UsageError says what is wrong)."""
    from ..cli.common import UsageError, resolve_targets

    why = available()
    if why:
        raise UsageError(f"--simulate: {why}")
    if (args.device or "cpu") != "cpu":
        raise UsageError("--simulate runs on CPU (LocalTensorMode over a fake process group)")
    names = resolve_targets(args.target)
    if args.target == "all":
        names = [n for n in names if n in SIMULATED_TARGETS]
        args.target = ",".join(names)
    other = [n for n in names if n not in SIMULATED_TARGETS]
    if other:
        raise UsageError(f"--simulate runs {', '.join(SIMULATED_TARGETS)}; not {', '.join(other)} "
                         "(docs/simulate.md says why)")
    if args.checkpoints == "all":
        raise UsageError("--simulate draws no checkpoints: torch.save, broadcast_from_rank0 and DCP of LocalTensors "
                         "fail under LocalTensorMode (docs/simulate.md)")
    if args.checkpoints == "some":  # the default: said, not silent
        print("fuzzshard: --simulate: no checkpoints (saving and loading LocalTensors is not simulated: "
              "docs/simulate.md)", file=sys.stderr)
        args.checkpoints = "none"
    if args.world_sizes is None:  # not given: a simulated session is for the sizes a pool cannot reach
        args.world_sizes = DEFAULT_WORLD_SIZES
    if args.case_timeout is None:  # not given: a simulated case runs its W ranks one after the other
        args.case_timeout = SIMULATED_CASE_TIMEOUT
    args.simulate_workers = max(1, os.cpu_count() or 1)  # one simulated case per core, side by side
    # dims that grow with the world size: at 64 ranks, dims of 1-9 would leave most shards empty
    args.simulate_draws = {"dims_up_to_world": True, **({"mesh_dims": 3} if all(n in THREE_DIM_TARGETS for n in names)
                                                        else {})}


class SimulatedSession(Session):
    """fuzz --simulate's session: its book (findings/simulated.py's SimulatedBook) sets LocalTensor's own
    errors aside, unshrunk, for the real-process check at the session's end (``book.set_aside``)."""
    book_class = SimulatedBook  # Session's hook for the book a kind of session keeps (session/engine.py)
