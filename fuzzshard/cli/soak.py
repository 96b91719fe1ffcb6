"""`fuzzshard soak`: a long run in cells of workers (torchrun, SLURM), resumable."""
from __future__ import annotations

import argparse
import os

from .common import (
    WORLD_SIZES, Renamed, UsageError, check_gpus, check_pool_args, count, draw_args, out_dir, parse_duration,
    parse_world_sizes, pool_args, pool_options, redis_url, resolve_targets, draws, warn_cores, whole,
)


def add(sub) -> None:
    so = sub.add_parser("soak", help="a long run in cells of workers, with shared findings and resume (torchrun, SLURM)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SOAK_EXAMPLES,
                        description="Split --workers ranks into cells (re-drawn every --epoch) that fuzz concurrently, "
                        "each with its own seed, sharing one example database and one findings folder in --out. "
                        "Under torchrun every process does this over its own --workers ranks, all sharing --out. "
                        "SIGTERM or Ctrl-C stops cleanly; the same command resumes.\n"
                        "Exit 0: --out holds no finding (always 0 under torchrun, which would restart a process that exits 1); "
                        "1: it holds findings; 2: usage error.")
    so.add_argument("--duration", required=True, help="how long this invocation runs, e.g. 90s, 10m, 8h")
    so.add_argument("--out", required=True, metavar="DIR", help="the run's folder (shared by every node and every restart)")
    so.add_argument("--target", dest="targets", default="all", metavar="TARGET",
                    help="target name(s), comma-separated, or 'all' (default: all)")
    so.add_argument("--targets", dest="targets", action=Renamed, new="--target", help=argparse.SUPPRESS)
    so.add_argument("--workers", type=count, default=4, help="ranks on this machine, or per torchrun process (default 4)")
    so.add_argument("--cells", default=None, metavar="SIZES",
                    help="fixed cell sizes, e.g. 2,1,1 (default: a new random split of --workers every epoch); "
                         "under torchrun they split all processes' ranks in rank order, so 1,2,1 over two "
                         "processes of 2 makes a middle cell that spans both")
    so.add_argument("--epoch", default="10m", help="how long one layout of cells lasts (default 10m)")
    so.add_argument("--seed", type=whole, default=0, metavar="N",
                    help="the run's seed; cells, epochs and torchrun ranks derive theirs (default 0)")
    so.add_argument("--redis", default=None, metavar="URL",
                    help="share the example database through redis (redis://host:port/db) instead of OUT/db")
    draw_args(so)
    pool_args(so)


def run(args) -> int:
    from ..session.soak import Soak, SoakOptions

    duration, epoch = parse_duration(args.duration, "--duration"), parse_duration(args.epoch, "--epoch")
    sizes = parse_world_sizes(args.world_sizes or WORLD_SIZES)
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    out_dir(args.out)
    warn_cores(args.workers)
    cells = None
    if args.cells:
        try:
            cells = [int(x) for x in args.cells.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--cells takes comma-separated sizes, got {args.cells!r}") from None
        if not cells or min(cells) < 1 or max(cells) > max(sizes):
            raise UsageError(f"--cells sizes must be 1..{max(sizes)} (the largest --world-sizes), got {args.cells!r}")
        # the cells say how many ranks; under torchrun they split every process's ranks together
        from ..session.soak import torchrun_slot

        procs = (torchrun_slot() or {"world": 1})["world"]
        if sum(cells) % procs:
            raise UsageError(f"--cells sizes must add up to a multiple of the {procs} torchrun processes, got {args.cells!r}")
        args.workers = sum(cells) // procs
    check_pool_args(args)
    check_gpus(args, args.workers)
    if args.redis:
        redis_url(args.redis)
    options = SoakOptions(draws(args, resolve_targets(args.targets), sizes), pool=pool_options(args),
                          plugins=tuple(os.path.abspath(p) for p in args.plugin or []),  # each finding records them
                          database=args.redis)
    return Soak(options, args.workers, duration, epoch, args.out, args.seed, cells=cells).run()


SOAK_EXAMPLES = """
examples:
  fuzzshard soak --duration 2h --workers 4 --out soak1                   # one machine
  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      -m fuzzshard soak --duration 8h --workers 8 --device cuda --out /shared/run1
  fuzzshard report soak1                                                 # tables + soak1/report.html
ready-made launchers, in fuzzshard's source tree (not an installed package): ci/torchrun/soak.sh, ci/slurm/soak.sbatch
"""

