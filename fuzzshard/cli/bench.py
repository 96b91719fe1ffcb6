"""`fuzzshard bench`: per-case cost and session benchmarks (ratios against a baseline in the same run)."""
from __future__ import annotations

import argparse

from .common import (
    Renamed, UsageError, check_gpus, count, model_families, parse_duration, parse_world_sizes, resolve_targets, whole,
)


def add(sub) -> None:
    b = sub.add_parser("bench", help="warm pool vs a fresh process group per case and vs the bare training loop, "
                                     "same cases, one run",
                       description="Per-case cost, measured on the same cases in one run: the warm pool fuzzshard "
                       "uses, a fresh process group per case, and the bare training loop with no checking. The last "
                       "line ends with the ratio (e.g. '41.4x'). A benchmark, never a test: compare numbers from one "
                       "machine and one run.")
    b.add_argument("--max-examples", dest="cases", type=count, default=30, metavar="N",
                   help="cases drawn per mode, as fuzz's --max-examples (default 30)")
    b.add_argument("--cases", dest="cases", type=count, action=Renamed, new="--max-examples", help=argparse.SUPPRESS)
    b.add_argument("--world-sizes", default="2",
                   help="comma-separated world sizes, as fuzz takes them: the comparison runs at each (default 2)")
    b.add_argument("--world-size", dest="world_sizes", action=Renamed, new="--world-sizes", help=argparse.SUPPRESS)
    b.add_argument("--seed", type=whole, default=0, metavar="N", help="the seed of the cases drawn (default 0)")
    b.add_argument("--target", default="dtensor", metavar="TARGET",
                   help="which target's cases to run: one name (default dtensor)")
    b.add_argument("--models", default=None, metavar="FAMILIES",
                   help="model families of the cases, as fuzz takes them (default topologies; decoder: transformers)")
    b.add_argument("--scaling", action="store_true",
                   help="instead: cases/s and the per-case split against world size 1-4, model depth and steps "
                        "(--max-examples per world size)")
    b.add_argument("--soak", default=None, metavar="DURATION",
                   help="instead: a soak in cells vs one fuzz session, both on --workers ranks for DURATION each")
    b.add_argument("--session", action="store_true",
                   help="instead: one fuzz session over world sizes 1..--workers (--max-examples, --seed), one "
                        "case at a time vs side by side on disjoint ranks, each on its own pool")
    b.add_argument("--workers", type=count, default=4, help="ranks for --soak and --session (default 4)")
    b.add_argument("--simulate", action="store_true",
                   help="instead: cases/s of the same cases simulated under LocalTensorMode (one worker, and one "
                        "per core side by side) and real (a warm pool of W gloo processes) at W=2, 4, 8, and "
                        "simulated alone at W=16 and 64 (--max-examples per world size; docs/simulate.md)")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the ranks run (default: cpu; cuda: NCCL, one GPU a rank)")
    from .hunt import add_arguments as hunt_arguments  # (here: `python -m fuzzshard.cli.hunt` imports no bench)

    hunt_arguments(b)  # --hunt: time to first finding of planted bugs (cli/hunt.py, session/hunt.py)


def run(args) -> int:
    from ..session.bench import run_bench

    if args.hunt:
        from . import hunt

        try:
            return hunt.run(args, lambda text: parse_duration(text, "--cap"))
        except (ValueError, OSError) as e:
            raise UsageError(f"--hunt: {e}") from None

    worlds = parse_world_sizes(str(args.world_sizes))
    if args.cases < 1:
        raise UsageError("--max-examples must be >= 1")
    names = resolve_targets(args.target)
    if len(names) != 1:
        raise UsageError("bench measures one target at a time")
    from ..session.options import Draws

    draws = Draws(tuple(names), tuple(worlds), device=args.device or "cpu",
                  models=tuple(model_families(args.models)) if args.models else None)
    if args.simulate:
        from ..session.bench import run_simulate_bench

        run_simulate_bench(args.cases, args.seed, names[0])
        return 0
    if args.soak:
        from ..session.bench import run_soak_bench

        run_soak_bench(parse_duration(args.soak, "--soak"), args.workers, names[0], args.seed)
        return 0
    if args.session:
        from ..session.bench import run_session_bench

        if args.workers < 2:
            raise UsageError("--session needs --workers >= 2 (side by side needs two ranks)")
        run_session_bench(args.cases, args.seed, names[0], worlds=range(1, args.workers + 1))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
        check_gpus(args, max(worlds))
    if args.scaling:
        from ..session.bench import run_scaling

        run_scaling(args.cases, args.seed, draws.replace(world_sizes=(1, 2, 3, 4)))  # (whatever --world-sizes says)
        return 0
    for world in worlds:
        run_bench(args.cases, args.seed, draws.replace(world_sizes=(world,)))
    return 0

