"""fuzzshard's command line. Exit codes: 0 nothing new found / passes now,
1 findings / still fails, 2 bad usage or input (one clear line on stderr)."""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

EXAMPLES = """
examples:
  fuzzshard fuzz --target dtensor --max-examples 50 --world-sizes 1,2,3 --out findings
  fuzzshard fuzz --target all --duration 10m --seed 7 --out findings
  fuzzshard fuzz --target dtensor --worker-setup my_patch.py   # patch torch / register a target
  fuzzshard replay findings/dtensor.parity.Adam.param.json    # 0 passes now, 1 still fails
  torchrun --nproc-per-node 2 findings/dtensor.parity.Adam.param.py   # no fuzzshard needed
  fuzzshard upstream findings/dtensor.parity.Adam.param.json -o issue.md   # an issue for pytorch/pytorch
  fuzzshard known --minimal                                     # which known torch bugs this torch still has
  fuzzshard show findings/dtensor.parity.Adam.param.json
  fuzzshard script fuzzshard/known/dtensor.parity.forward.Conv1d.json -o conv.py   # a repro to paste upstream
  fuzzshard known --check                                       # do known torch bugs still reproduce?
  fuzzshard bench                                               # warm pool vs fresh process groups
  fuzzshard soak --duration 2h --workers 4 --out soak1          # long run in cells; resumable
  fuzzshard report soak1                                        # its coverage and findings
"""


class UsageError(Exception):
    pass


class _Renamed(argparse.Action):
    """An old spelling of a flag, still accepted: it stores into the new one's
    place and says once, in one line, what the flag is called now."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"fuzzshard: note: {option_string} is now {self.new} (the old spelling still works)", file=sys.stderr)
        setattr(namespace, self.dest, values)


FILE_HELP = "a finding file (OUT/<signature>.json) or a bare case JSON"


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise UsageError(f"cannot read duration {text!r}: use e.g. 90s, 10m, 8h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--world-sizes takes comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise UsageError(f"world sizes must be >= 1, got {text!r}")
    if sizes[-1] > 64:
        raise UsageError(f"world size {sizes[-1]} is more ranks than one machine's pool can hold (max 64)")
    return sizes


SOAK_EXAMPLES = """
examples:
  fuzzshard soak --duration 2h --workers 4 --out soak1                   # one machine
  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      -m fuzzshard soak --duration 8h --workers 8 --device cuda --out /shared/run1
  fuzzshard report soak1                                                 # tables + soak1/report.html
ready-made launchers: ci/torchrun/soak.sh, ci/slurm/soak.sbatch
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fuzzshard",
        description="Property-based fuzzing of PyTorch's sharded training stacks: random training setups run "
        "sharded and unsharded on real process groups; divergences shrink to standalone repro scripts.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("fuzz", help="run a fuzz session", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Draw cases, run each sharded and as an anchored reference, shrink every "
                       "divergence and write OUT/<signature>.json + .py.\nExit 0: no new finding; 1: new findings; 2: usage error.")
    from .targets import names as target_names  # the registry imports no torch

    f.add_argument("--target", default="dtensor",
                   help=f"target name(s), comma-separated, or 'all': {', '.join(target_names())} (default: dtensor)")
    f.add_argument("--targets", dest="target", action=_Renamed, new="--target", help=argparse.SUPPRESS)
    g = f.add_mutually_exclusive_group()
    g.add_argument("--max-examples", type=int, default=None, help="cases to draw per target (default 100)")
    g.add_argument("--duration", help="run for this long instead, e.g. 90s, 10m, 8h")
    f.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, printed)")
    f.add_argument("--out", default="fuzzshard-out",
                   help="findings and the example database go here (default: fuzzshard-out)")
    f.add_argument("--shrink-budget", default=None, metavar="DURATION",
                   help="once a round finds something, how much longer it may search and shrink before it ends "
                        "with its smallest cases (default: a quarter of --duration, at least 30s, at most 5m; "
                        "5m with --max-examples)")
    f.add_argument("--redis", default=None, metavar="URL",
                   help="share the example database through redis (redis://host:port/db); OUT/.hypothesis is "
                        "written too, and used alone if the server goes away")
    f.add_argument("--one-at-a-time", action="store_true",
                   help="run one case at a time. By default, cases that need fewer ranks than the pool are drawn "
                        "in packs and run side by side on disjoint ranks, so a world-size-1 case does not leave "
                        "three ranks waiting (2.5x the cases/s of a session over world sizes 1-4 here); a packed "
                        "session draws other cases than one at a time with the same seed")
    _draw_args(f)
    _pool_args(f)

    so = sub.add_parser("soak", help="a long run in cells of workers, with shared findings and resume (torchrun, SLURM)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SOAK_EXAMPLES,
                        description="Split --workers ranks into cells (re-drawn every --epoch) that fuzz concurrently, "
                        "each with its own seed, sharing one example database and one findings folder in --out. "
                        "Under torchrun every process does this over its own --workers ranks, all sharing --out. "
                        "SIGTERM or Ctrl-C stops cleanly; the same command resumes.\n"
                        "Exit 0: --out holds no finding (always 0 under torchrun, which would restart a process that exits 1); "
                        "1: it holds findings; 2: usage error.")
    so.add_argument("--duration", required=True, help="how long this invocation runs, e.g. 90s, 10m, 8h")
    so.add_argument("--out", required=True, help="the run's folder (shared by every node and every restart)")
    so.add_argument("--target", dest="targets", default="all",
                    help="target name(s), comma-separated, or 'all' (default)")
    so.add_argument("--targets", dest="targets", action=_Renamed, new="--target", help=argparse.SUPPRESS)
    so.add_argument("--workers", type=int, default=4, help="ranks on this machine, or per torchrun process (default 4)")
    so.add_argument("--cells", default=None, metavar="SIZES",
                    help="fixed cell sizes, e.g. 2,1,1 (default: a new random split of --workers every epoch); "
                         "under torchrun they split all processes' ranks in rank order, so 1,2,1 over two "
                         "processes of 2 makes a middle cell that spans both")
    so.add_argument("--epoch", default="10m", help="how long one layout of cells lasts (default 10m)")
    so.add_argument("--seed", type=int, default=0, help="the run's seed; cells, epochs and torchrun ranks derive theirs")
    so.add_argument("--redis", default=None, metavar="URL",
                    help="share the example database through redis (redis://host:port/db) instead of OUT/db")
    _draw_args(so)
    _pool_args(so)

    rp = sub.add_parser("report", help="coverage tables, findings and rate of a soak's --out; writes report.html",
                        description="A soak's coverage tables, its findings (new and known apart) and its rate, as "
                        "text, and as an HTML page (DIR/report.html).")
    rp.add_argument("dir", help="a soak's --out folder")
    rp.add_argument("--html", default=None, help="where to write the HTML page (default DIR/report.html)")

    r = sub.add_parser("replay", help="re-run a finding or case file: exit 0 passes now, 1 still fails with the "
                       "recorded signature, 3 fails with another, 2 bad file",
                       description="Re-run a finding or case file in fresh workers, on the device it was recorded on.\n"
                       "Exit 0: passes now; 1: fails with the recorded signature (the same bug); 3: fails with "
                       "another signature (both are printed); 2: unreadable or invalid file.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("file", help=FILE_HELP)
    _pool_args(r)

    s = sub.add_parser("show", help="print a finding or case file readably",
                       description="A finding or case file as a person reads it: the target, world size and mesh, the "
                       "model layer by layer, the optimizer and its groups, the schedule, the checkpoint, the options.")
    s.add_argument("file", help=FILE_HELP)

    sc = sub.add_parser("script", help="write the standalone torchrun repro script of a finding or case file",
                        description="The standalone repro of a finding or case: a torch-only script for `torchrun "
                        "--nproc-per-node W FILE.py` that exits 1 while the bug is there and 0 once it is fixed "
                        "(--setup PATCH.py runs a patch first). Straight-line where the case allows it, else "
                        "fuzzshard's kernel flattened around the case.")
    sc.add_argument("file", help=FILE_HELP)
    sc.add_argument("-o", "--output", help="write here instead of standard output")
    sc.add_argument("--flat", action="store_true", help="fuzzshard's whole kernel flattened around the case, not the "
                    "straight-line script of what the case uses (which dtensor and plain fsdp2 cases get)")

    up = sub.add_parser("upstream", help="write an issue-ready report of a finding for pytorch/pytorch",
                        description="An issue for pytorch/pytorch from a finding: a title in PyTorch's style, the "
                        "hand-reduced script of its root cause where known/minimal/ has one, else the straight-line "
                        "script generated from the case (the flattened one, attached, where it cannot be written), "
                        "what it prints here as the evidence, expected vs actual from that output, the torch source "
                        "suspected, and versions (torch.utils.collect_env).")
    up.add_argument("file", help=FILE_HELP)
    up.add_argument("-o", "--output", help="write the markdown here (a script too long for an issue body is "
                    "written beside it as OUTPUT.repro.py); default: standard output, the script into the current folder")
    up.add_argument("--no-run", action="store_true", help="do not run the script (nor collect_env) first")

    k = sub.add_parser("known", help="the known findings in torch, by root cause; --check replays them, "
                                     "--minimal runs the hand-reduced scripts",
                       description="The torch bugs fuzzshard has found (fuzzshard/known/), by root cause: how each "
                       "shows, where it stands upstream, its findings. A session counts a known finding as a known "
                       "hit, not a new one. --check replays every one on this torch; --minimal runs the "
                       "hand-reduced scripts.")
    k.add_argument("--check", action="store_true", help="replay each and say whether it still reproduces")
    k.add_argument("--markdown", action="store_true", help="print the list as a Markdown table (known/README.md)")
    k.add_argument("--minimal", nargs="*", metavar="ROOT_CAUSE",
                   help="run the hand-reduced scripts of these root causes (none named: all) under torchrun here and "
                        "say, per root cause, whether each still reproduces (a quick check of another torch version)")
    _pool_args(k)

    b = sub.add_parser("bench", help="warm pool vs a fresh process group per case and vs the bare training loop, "
                                     "same cases, one run",
                       description="Per-case cost, measured on the same cases in one run: the warm pool fuzzshard "
                       "uses, a fresh process group per case, and the bare training loop with no checking. The last "
                       "line ends with the ratio (e.g. '41.4x'). A benchmark, never a test: compare numbers from one "
                       "machine and one run.")
    b.add_argument("--cases", type=int, default=30, help="cases per mode (default 30)")
    b.add_argument("--world-sizes", dest="world_size", type=int, default=2, metavar="N",
                   help="the world size of the cases (one; default 2)")
    b.add_argument("--world-size", dest="world_size", type=int, action=_Renamed, new="--world-sizes",
                   help=argparse.SUPPRESS)
    b.add_argument("--seed", type=int, default=0, help="the seed of the cases drawn (default 0)")
    b.add_argument("--target", default="dtensor", help="which target's cases to run (default dtensor)")
    b.add_argument("--models", default=None, metavar="FAMILIES",
                   help="model families of the cases, as fuzz takes them (default topologies; decoder: transformers)")
    b.add_argument("--scaling", action="store_true",
                   help="instead: cases/s and the per-case split against world size 1-4, model depth and steps "
                        "(--cases per world size)")
    b.add_argument("--soak", default=None, metavar="DURATION",
                   help="instead: a soak in cells vs one fuzz session, both on --workers ranks for DURATION each")
    b.add_argument("--session", action="store_true",
                   help="instead: one fuzz session over world sizes 1..--workers (--cases examples, --seed), one "
                        "case at a time vs side by side on disjoint ranks, each on its own pool")
    b.add_argument("--workers", type=int, default=4, help="ranks for --soak and --session (default 4)")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the ranks run (cuda: NCCL, one GPU a rank)")
    return ap


def _draw_args(p) -> None:
    p.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated world sizes to draw from (default 1,2,3,4)")
    p.add_argument("--optimizers", default=None, help="restrict to these torch.optim classes, comma-separated")
    p.add_argument("--models", default=None, metavar="FAMILIES",
                   help="model families to draw, comma-separated: topologies (random trees of Linear, Embedding, "
                        "LayerNorm, Conv1d; the default), decoder (a Llama-style transformer: SDPA attention with "
                        "rotary embeddings and grouped-query heads, SwiGLU or GELU MLP, RMSNorm or LayerNorm, tied "
                        "head or not, cross-entropy on token targets; fsdp2 draws torchtitan-style TP plans for it)")
    p.add_argument("--compile", action="store_true",
                   help="fsdp2 also draws torch.compile (inductor) of each block, before or after fully_shard as "
                        "torchtitan does, and of the optimizer step; the reference stays eager. Off by default: a "
                        "compile costs seconds a case")
    p.add_argument("--checkpoints", choices=["some", "all", "none"], default="some",
                   help="save mid-schedule and resume from a fresh model (full state dict, broadcast from rank 0, or "
                        "DCP files, at any of the world sizes) in some cases (default), every case, or none")


def _pool_args(p) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the ranks run (default: cpu; replay: the device the case was recorded on)")
    p.add_argument("--backend", default=None, help="process group backend (default: gloo on cpu, nccl on cuda)")
    p.add_argument("--plugin", action="append", default=None, metavar="FILE.py",
                   help="your own optimizer, model or parallelism, from one file (fuzzshard.plugin.optimizer / "
                        ".model / .parallelism; see examples/): drawn beside the built-in ones (a parallelism is "
                        "--target NAME); recorded in each finding, so replay loads it again; may be given more than once")
    p.add_argument("--worker-setup", default=None, metavar="FILE.py",
                   help="Python file run in every worker before any case: patch torch, register_target(...)")
    p.add_argument("--case-timeout", type=float, default=120.0, metavar="SEC",
                   help="a case still running after this is a hang finding (default 120)")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        command = {"fuzz": cmd_fuzz, "soak": cmd_soak, "report": cmd_report, "replay": cmd_replay, "show": cmd_show,
                   "script": cmd_script, "upstream": cmd_upstream, "known": cmd_known,
                   "bench": cmd_bench}[args.command]
        return command(args)
    except UsageError as e:
        print(f"fuzzshard: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path given on the command line that cannot be read or written: one line
        if not e.filename:
            raise
        print(f"fuzzshard: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fuzzshard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fuzzshard known | head`
        sys.stderr.close()
        return 0


def _out_dir(path: str) -> None:
    """--out made (or there already), or one clear line: under a regular file, not writable, ..."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise UsageError(f"--out {path}: cannot make or write that folder ({e.strerror})") from None


def _warn_cores(ranks: int) -> None:
    """More ranks than cores runs (each rank is a process), slowly: said once, not refused."""
    cores = os.cpu_count() or 1
    if ranks > cores:
        print(f"fuzzshard: note: {ranks} ranks on {cores} CPU core(s): each rank is a process, so cases of that size "
              f"run slowly here and may reach --case-timeout", file=sys.stderr)


def _check_pool_args(args, device: str | None = None) -> None:
    args.device = args.device or device or "cpu"
    # the plugins first, then --worker-setup (which may patch what a plugin brings): each runs in every worker
    args.setups = [os.path.abspath(p) for p in (args.plugin or []) + [args.worker_setup] if p]
    for flag, path in [("--plugin", p) for p in args.plugin or []] + [("--worker-setup", args.worker_setup)]:
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag}: no such file {path!r}")
    if args.case_timeout <= 0:
        raise UsageError("--case-timeout must be positive")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
        if (args.backend or "nccl") == "gloo":
            raise UsageError("--device cuda runs on NCCL: gloo with CUDA tensors fails in collectives fuzzshard's "
                             "targets use ('writev ... Bad address'), so it is no stand-in for several GPUs")
    for path in args.setups:  # the same files run here, so their registrations are seen by the strategies
        _run_setup(path)


def _run_setup(path: str) -> None:
    """A --plugin or --worker-setup file, run in this process."""
    from .worker import run_setup_file

    try:
        run_setup_file(path)
    except Exception as e:
        raise UsageError(f"{path} failed: {type(e).__name__}: {e}") from None


def _recorded_plugins(environment, given=()) -> list[str]:
    """The --plugin files a finding's environment records that are still
    here, less those ``given`` on the command line."""
    plugins = environment.get("plugins") if isinstance(environment, dict) else None
    given = {os.path.abspath(p) for p in given}
    return [p for p in plugins or [] if isinstance(p, str) and os.path.isfile(p) and p not in given]


def _pool(args, size: int, log_dir=None, spare: bool = False, placed: bool = False):
    """``spare``: keep a warm second set of workers for instant restarts (long sessions);
    ``placed``: run cases side by side (Pool.run_many)."""
    from .runner import Pool, PoolError

    try:
        return Pool(size, device=args.device, backend=args.backend, worker_setup=args.setups,
                    case_timeout=args.case_timeout, log_dir=log_dir, spare=spare, placed=placed).start()
    except PoolError as e:
        raise UsageError(f"could not start {size} workers: {e}") from None


def _resolve_targets(text: str) -> list[str]:
    from . import targets

    names = targets.names() if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in targets.names()]
    if unknown or not names:
        raise UsageError(f"unknown target {', '.join(unknown) or text!r} (known: {', '.join(targets.names())}, all)")
    return names


def cmd_fuzz(args) -> int:
    import signal

    from .engine import Session

    sizes = parse_world_sizes(args.world_sizes)
    duration = parse_duration(args.duration) if args.duration else None
    shrink_budget = parse_duration(args.shrink_budget) if args.shrink_budget else None
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError("--max-examples must be >= 1")
    _check_pool_args(args)
    _check_gpus(args, max(sizes))
    names = _resolve_targets(args.target)
    strategy_kwargs = _strategy_kwargs(args)
    from . import targets

    if args.compile and not any(targets.get(n).spec.compiled for n in names):
        compiling = [n for n in targets.names() if targets.get(n).spec.compiled]
        raise UsageError(f"--compile: none of {', '.join(names)} draws torch.compile (these do: {', '.join(compiling)})")
    database = _redis(args.redis) if args.redis else None
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    _out_dir(args.out)
    _warn_cores(max(sizes))
    print(f"fuzzshard: targets {','.join(names)} · world sizes {sizes} · seed {seed} · out {args.out}", file=sys.stderr)
    session = None
    stops = []

    def stop(signum, frame):
        """The first signal ends the session after its current case; a second one at once."""
        stops.append(signum)
        name = signal.Signals(signum).name
        if session is None or len(stops) > 1:
            raise KeyboardInterrupt(name)
        session.request_stop(name)
        print(f"\nfuzzshard: {name}: stopping after the current case (again to stop at once)", file=sys.stderr,
              flush=True)

    # explicit handlers: a shell starts a background job with SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    pool = _pool(args, max(sizes), log_dir=os.path.join(args.out, "logs"), spare=True, placed=not args.one_at_a_time)
    try:
        session = Session(pool, names, args.out, world_sizes=sizes, max_examples=args.max_examples or 100,
                          duration=duration, seed=seed, device=args.device, strategy_kwargs=strategy_kwargs,
                          database=database, shrink_budget=shrink_budget, plugins=args.plugin or ())
        if session.pack > 1:
            print(f"fuzzshard: cases drawn in packs of up to {session.pack}, run side by side on disjoint ranks of "
                  f"{pool.size} (--one-at-a-time: one at a time)", file=sys.stderr)
        try:
            session.run()
        except KeyboardInterrupt:  # the second signal: every finding seen is on disk already
            print("fuzzshard: stopped at once; the finding files are as they were", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # closing the pool is not to be interrupted
        pool.close()
    findings = list(session.findings.values())
    _print_session_report(session, findings, args.out)
    if findings:
        return 1
    return 128 + stops[0] if stops else 0


def _check_gpus(args, ranks: int) -> None:
    """NCCL takes one rank per GPU: more ranks than GPUs is refused up front."""
    if args.device == "cuda":
        import torch

        if ranks > torch.cuda.device_count():
            raise UsageError(f"world size {ranks} needs {ranks} GPUs (NCCL runs one rank per GPU); this machine "
                             f"has {torch.cuda.device_count()}: use --world-sizes up to {torch.cuda.device_count()}")


def _redis(url: str) -> str:
    try:
        import redis  # noqa: F401
    except ImportError:
        raise UsageError("--redis needs the redis package (pip install redis)") from None
    if not url.startswith("redis://"):
        raise UsageError(f"--redis takes a redis://host:port/db URL, got {url!r}")
    return url


def _strategy_kwargs(args) -> dict:
    out = {"checkpoint": {"some": None, "all": True, "none": False}[args.checkpoints]}
    if args.optimizers:
        from fuzzshard.strategies.optimizers import available

        opts = [o.strip() for o in args.optimizers.split(",")]
        bad = [o for o in opts if o not in available()]
        if bad:
            raise UsageError(f"unknown optimizer(s) {bad} (known: {', '.join(available())})")
        out["optimizer_names"] = opts
    if args.models:
        out["models"] = _model_families(args.models)
    if args.compile:
        out["compile"] = True
    return out


def _model_families(text: str) -> list[str]:
    from fuzzshard.strategies.models import FAMILIES

    families = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in families if m not in FAMILIES]
    if bad or not families:
        raise UsageError(f"unknown model family {bad or text!r} (known: {', '.join(FAMILIES)})")
    return families


def cmd_soak(args) -> int:
    from .soak import Soak

    duration, epoch = parse_duration(args.duration), parse_duration(args.epoch)
    sizes = parse_world_sizes(args.world_sizes)
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    _out_dir(args.out)
    _warn_cores(args.workers)
    cells = None
    if args.cells:
        try:
            cells = [int(x) for x in args.cells.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--cells takes comma-separated sizes, got {args.cells!r}") from None
        if not cells or min(cells) < 1 or max(cells) > max(sizes):
            raise UsageError(f"--cells sizes must be 1..{max(sizes)} (the largest --world-sizes), got {args.cells!r}")
        # the cells say how many ranks; under torchrun they split every process's ranks together
        from .soak import torchrun_slot

        procs = (torchrun_slot() or {"world": 1})["world"]
        if sum(cells) % procs:
            raise UsageError(f"--cells sizes must add up to a multiple of the {procs} torchrun processes, got {args.cells!r}")
        args.workers = sum(cells) // procs
    _check_pool_args(args)
    _check_gpus(args, args.workers)
    if args.redis:
        _redis(args.redis)
    options = {"targets": _resolve_targets(args.targets), "world_sizes": sizes, "device": args.device,
               "backend": args.backend, "worker_setup": args.setups,
               "plugins": [os.path.abspath(p) for p in args.plugin or []],  # recorded in each finding, for replay
               "case_timeout": args.case_timeout, "strategy_kwargs": _strategy_kwargs(args), "database": args.redis}
    return Soak(options, args.workers, duration, epoch, args.out, args.seed, cells=cells).run()


def cmd_report(args) -> int:
    from pathlib import Path

    from .report import html_page, summarize, text

    if not Path(args.dir, "cells").is_dir():
        raise UsageError(f"{args.dir} holds no soak run (no cells/ folder)")
    s = summarize(args.dir)
    sys.stdout.write(text(s))
    page = Path(args.html or Path(args.dir) / "report.html")
    page.write_text(html_page(s, f"fuzzshard soak {args.dir}"))
    print(f"\nHTML report: {page}")
    return 0


def _print_session_report(session, findings, out) -> None:
    st = session.stats
    print(f"\n{st.cases} cases · {st.valid} valid · {st.invalid} invalid · {st.rate():.2f} cases/s", file=sys.stderr)
    length = f"session {session.elapsed:.0f}s"
    if session.duration:
        length += f" (--duration {session.duration:.0f}s, grace {session.grace():.0f}s)"
    if session.stop_reason:
        length += f", stopped by {session.stop_reason}"
    print(length, file=sys.stderr)
    pool = session.pool
    if pool.restarts:  # what hangs, crashes and ranks stuck after another rank raised cost the session
        print(f"pool restarts: {pool.restarts} ({pool.stuck_seconds:.0f}s waiting for ranks stuck after another "
              f"raised, {pool.restart_seconds:.0f}s restarting)", file=sys.stderr)
    if st.derived_timeouts or st.slow:
        print(f"while a hang shrank: {st.derived_timeouts} case(s) ran under a derived timeout of "
              f"{st.derived_timeout:.0f}s (--case-timeout {session.pool.case_timeout:.0f}s); {st.slow} provisional "
              f"hang(s) finished at the full timeout (slow, not hung)", file=sys.stderr)
    if st.passed_by_optimizer:
        by = st.passed_by_implementation
        cover = ", ".join(f"{k} {v} ({'·'.join(str(by[k, i]) for i in ('forloop', 'foreach', 'fused'))})"
                          for k, v in sorted(st.passed_by_optimizer.items()))
        print(f"passing cases by optimizer (for-loop·foreach·fused): {cover}", file=sys.stderr)
    if st.passed_decoder:
        cover = ", ".join(f"{k} {v}" for k, v in st.passed_decoder.most_common())
        print(f"passing decoder cases by TP plan element: {cover}", file=sys.stderr)
    from .rootcause import grouped

    matcher = session.matcher
    stage = {"confirmed": "", "shrinking": " (shrunk in warm workers, not yet re-run fresh: `fuzzshard replay` it)",
             "unconfirmed": " (UNCONFIRMED: no time was left to re-run it in fresh workers)"}
    groups = grouped(findings, matcher)
    for key, members in groups.items():  # new findings first: what the user came for
        if len(groups) > 1 or len(members) > 1 or key.startswith("root cause"):
            print(f"{key}: {len(members)} finding(s)", file=sys.stderr)
        for f in members:
            _print_finding(f, out, stage.get(f.stage, ""), st.folded.get(f.signature, 0))
    for c in session.contaminated:
        print(f"CONTAMINATED (a fuzzshard internal error, not a finding): {c['signature']} in warm workers, "
              f"{c['fresh_signature']} in fresh ones, after {len(c['ran_before_in_that_generation'])} other case(s)"
              f"\n        -> {out}/contaminated/{c['signature']}.json", file=sys.stderr)
    if st.internal_errors:
        print(f"{st.internal_errors} fuzzshard-internal errors, not findings (see above; cases in {out}/internal/)",
              file=sys.stderr)
    by_cause: dict[str, list] = {}
    for sig, n in sorted(st.known.items()):  # known hits under their root cause: one bug, one line
        by_cause.setdefault(session.known[sig].root_cause or sig, []).append((sig, n))
    for cause, hits in sorted(by_cause.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        rc = matcher.causes.get(cause)
        n = sum(k for _, k in hits)
        faces = f", {len(hits)} signatures" if len(hits) > 1 else ""
        print(f"known   {cause} ×{n}{faces} [{rc.upstream_text}]" if rc else f"known   {cause} ×{n}", file=sys.stderr)
    if findings:
        faces = sum(1 + len(f.faces) for f in findings)
        print(f"{len(findings)} new finding(s), one per bug, under {faces} signature(s); to get there "
              f"{st.generalized} variant run(s) generalized them and {st.reduced_runs} edited run(s) in "
              f"{st.reduce_seconds:.0f}s reduced them", file=sys.stderr)
        _write_index(out, groups, matcher)
    else:
        print("no new findings" + (f" ({sum(st.known.values())} known hits, `fuzzshard known` says what they are)"
                                   if st.known else ""), file=sys.stderr)


def _print_finding(f, out, stage: str, folded: int) -> None:
    """A new finding: its summary, its other faces, what the reducer took out, what it fails and passes with, its files."""
    from .findings import summary
    from .generalize import Face, table_text

    print(f"FINDING {f.signature}{stage}\n        {summary(f.verdict)}", file=sys.stderr)
    if f.faces:
        print(f"        one bug, also seen as {', '.join(f.faces)}" + (f" ({folded} case(s) met it so)" if folded else ""),
              file=sys.stderr)
    if f.removed:
        shown = ", ".join(f.removed[:5]) + (f" and {len(f.removed) - 5} more" if len(f.removed) > 5 else "")
        print(f"        1-minimal: the reducer took out {shown}", file=sys.stderr)
    if f.generalization:
        table = table_text([Face(**row) for row in f.generalization])
        print("".join(f"        {line}\n" for line in table.splitlines()), end="", file=sys.stderr)
    print(f"        -> {out}/{f.signature}.json, {out}/{f.signature}.py (torchrun --nproc-per-node {f.case.ranks})",
          file=sys.stderr)


def _write_index(out, groups: dict, matcher) -> None:
    """OUT/INDEX.md: the session's new findings grouped by suspected root cause."""
    from pathlib import Path

    from .findings import atomic_write, summary
    from .rootcause import address

    lines = ["# New findings by suspected root cause", "",
             "Grouped by what identifies a bug (see fuzzshard/rootcause.py): a group named after a known root "
             "cause has the address of its known findings; a `new:` group is one address no known finding has.", ""]
    for key, members in groups.items():
        lines += [f"## {key}", "", f"address: {address(members[0].case, members[0].verdict)}", ""]
        lines += [f"- [`{f.signature}`]({f.signature}.json) ({f.stage}): {summary(f.verdict)}" for f in members] + [""]
    atomic_write(Path(out) / "INDEX.md", "\n".join(lines))


def _recorded(path) -> dict:
    """A finding file's raw JSON, or {} (``_load`` then says what is wrong with it)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) and isinstance(data.get("case", {}), dict) else {}
    except (OSError, ValueError):
        return {}


def _load(path):
    from .case import CaseError
    from .findings import load_finding

    try:
        finding = load_finding(path)
    except CaseError as e:
        raise UsageError(f"{path}: {e}") from None
    from . import targets

    if finding.case.target not in targets.names():  # a plugin's parallelism: the finding names its file
        for plugin in _recorded_plugins(finding.environment):
            _run_setup(plugin)
    if finding.case.target not in targets.names():
        raise UsageError(f"{path}: unknown target {finding.case.target!r} (known: {', '.join(targets.names())})")
    try:
        finding.case.check_world()
    except CaseError as e:
        raise UsageError(f"{path}: {e}") from None
    return finding


REPLAY_DIFFERENT = 3  # exit code: the case fails, with another signature than the one recorded


def cmd_replay(args) -> int:
    from .findings import summary
    from .judge import judge

    recorded = _recorded(args.file)
    # the plugins the finding was found with (its optimizer, model or parallelism) load again, wherever they still are
    args.plugin = (args.plugin or []) + _recorded_plugins(recorded.get("environment"), args.plugin or [])
    # a case replays where it was found, unless told otherwise
    _check_pool_args(args, device=recorded.get("case", {}).get("device"))
    finding = _load(args.file)
    case = finding.case
    _check_gpus(args, case.ranks)
    if args.device != case.device:
        print(f"note: {args.file} was recorded on {case.device}; replaying on {args.device}", file=sys.stderr)
    pool = _pool(args, case.ranks)
    try:
        j = judge(pool, case)
    finally:
        pool.close()
    v, sig = j.verdict, j.signature
    if v["status"] == "invalid":
        raise UsageError(f"{args.file}: the case is invalid: {v['reason']}")
    if v["status"] == "error":
        raise UsageError(f"{args.file}: fuzzshard could not run the case: {v['error']}")
    if v["status"] == "pass":
        print(f"PASS: {args.file} no longer fails" + (f" ({finding.signature})" if finding.signature else ""))
        return 0
    if finding.signature and sig != finding.signature:
        print(f"FAILS DIFFERENTLY: {sig}\n  recorded: {finding.signature}\n  now:      {sig}\n{summary(v)}")
        return REPLAY_DIFFERENT
    print(f"FAIL: {sig}\n{summary(v)}")
    for m in v.get("mismatches", [])[1:]:
        print(f"  also: {m['quantity']} {m['fqn']} step {m['step']}: {m['detail']}")
    return 1


def cmd_show(args) -> int:
    from .show import render

    print(render(_load(args.file)))
    return 0


def cmd_script(args) -> int:
    from . import repro
    from .findings import summary

    finding = _load(args.file)
    text = repro.script(finding.case, summary(finding.verdict) if finding.verdict else "", finding.environment,
                        flat=args.flat)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_upstream(args) -> int:
    from pathlib import Path

    from .findings import load_known
    from .upstream import report

    finding = _load(args.file)
    out = Path(args.output) if args.output else None
    attachment = out.with_suffix(".repro.py") if out else Path("repro.py")
    text, attach = report(finding, load_known(), run=not args.no_run, attachment=attachment)
    for name, body in attach.items():
        (attachment.parent / name).write_text(body)
        print(f"wrote {attachment.parent / name}: attach it to the issue", file=sys.stderr)
    if out:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_known(args) -> int:
    from .findings import load_known
    from .judge import judge
    from .rootcause import load_root_causes

    known = load_known()
    if not known:
        print("no known findings")
        return 0
    if args.markdown:
        print(known_markdown(known))
        return 0
    causes = load_root_causes(known)
    if args.minimal is not None:
        return _check_minimal(causes, args.minimal)
    pool = None
    if args.check:
        _check_pool_args(args)
        here = [f for f in known.values() if f.case.device == args.device]
        if here:
            ranks = max(f.case.ranks for f in here)
            if args.device == "cuda":
                import torch

                ranks = min(ranks, torch.cuda.device_count())
            pool = _pool(args, ranks)
    print(f"{len(causes)} root causes behind {len(known)} known findings in torch (--markdown: the table with "
          f"upstream states; `fuzzshard show fuzzshard/known/SIG.json`: one finding)", flush=True)
    outcome: dict[str, list] = {}
    try:
        order = [(rc.id, rc.signatures) for rc in sorted(causes.values(), key=lambda rc: rc.id)]
        order += [("", [sig for sig, f in sorted(known.items()) if not f.root_cause])]
        for rid, sigs in order:
            if not sigs:
                continue
            rc = causes.get(rid)
            print(f"\n{rid} · {rc.kind} · {rc.upstream_text}\n    {rc.title}" if rc else "\n(no root cause recorded)",
                  flush=True)
            for sig in sigs:
                f, status = known[sig], ""
                if pool is not None:
                    if f.case.device != args.device or f.case.ranks > pool.size:
                        status = "skipped"
                    else:
                        got = judge(pool, f.case).label
                        status = "reproduces" if got == sig else "fixed" if got == "pass" else f"differs ({got})"
                    outcome.setdefault(rid or sig, []).append(status)
                print(f"    {sig}" + (f"  {status}" if status else "") + ("" if rc else f"\n        {f.diagnosis}"),
                      flush=True)
    finally:
        if pool is not None:
            pool.close()
    if outcome:
        print(f"\nroot cause on torch {_torch_version()}, {args.device}: still reproduces / fixed / now fails differently"
              f" / skipped (signatures)")
        for rid, got in outcome.items():
            n = {k: sum(1 for g in got if g.split(" ")[0] == k) for k in ("reproduces", "fixed", "differs", "skipped")}
            verdict = ("still reproduces" if n["reproduces"] else "FIXED" if n["fixed"] else
                       "NOW FAILS DIFFERENTLY" if n["differs"] else "skipped")
            print(f"  {rid:55} {verdict:22} {n['reproduces']} / {n['fixed']} / {n['differs']} / {n['skipped']}")
    return 0


def _check_minimal(causes: dict, only: list) -> int:
    """Each root cause's hand-reduced script, run here: exit 1 (and BUG REPRODUCED) is the bug."""
    from .upstream import run_minimal

    unknown = sorted(set(only) - set(causes))
    if unknown:
        raise UsageError(f"unknown root cause(s) {', '.join(unknown)} (see `fuzzshard known`)")
    chosen = [rc for rid, rc in sorted(causes.items()) if rc.minimal and (not only or rid in only)]
    print(f"hand-reduced scripts of {len(chosen)} root causes on torch {_torch_version()}: a failing exit with a "
          f"'BUG' line = still reproduces, 0 = does not, else fails otherwise (a script may need a GPU: it says so "
          f"at its top; an uncaught exception exits 1 too, without the line)", flush=True)
    for rc in chosen:
        code, printed = run_minimal(rc)
        verdict = ("DOES NOT REPRODUCE" if code == 0 else "still reproduces" if re.search(r"\bBUG\b", printed)
                   else f"fails otherwise (exit {code})")
        last = printed.strip().splitlines()[-1:] or [""]
        print(f"  {rc.id:55} {verdict:30} {last[0][:80]}", flush=True)
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def known_markdown(known: dict) -> str:
    from .findings import ORACLES
    from .rootcause import load_root_causes

    causes = load_root_causes(known)
    rows = ["# Known findings in PyTorch", "",
            "Divergences fuzzshard found in torch itself, first by root cause (the torch bug: its id, how it "
            "shows, where it stands upstream, and the findings it is behind), then one row per finding: the "
            "signature, a one-line diagnosis, the shrunk repro (`fuzzshard replay X.json`; `fuzzshard script "
            "X.json -o x.py` writes a standalone script for `torchrun --nproc-per-node W x.py`, torch alone). "
            "Regenerate this page with `fuzzshard known --markdown`; check them with `fuzzshard known --check`.", "",
            "## Root causes", "",
            "| root cause | kind | upstream | findings | what |", "|---|---|---|---|---|"]
    for rc in sorted(causes.values(), key=lambda rc: rc.id):
        minimal = f". Hand-reduced: [`{rc.minimal.rsplit('/', 1)[-1]}`](minimal/{rc.minimal.rsplit('/', 1)[-1]})." \
            if rc.minimal else ""
        rows.append(f"| `{rc.id}` | {rc.kind} | {rc.upstream_text.replace('|', '/')} | {len(rc.signatures)} "
                    f"| {rc.title.replace('|', '/')}{minimal} |")
    rows += ["", "## Findings", "", "| signature | kind | root cause | torch, device | W | diagnosis |",
             "|---|---|---|---|---|---|"]
    for sig, f in sorted(known.items()):
        oracle = ORACLES.get(f.verdict.get("oracle", ""))
        kind = "?" if oracle is None else oracle.kind.replace("silent", "**silent**")
        where = ", ".join(f.devices) if f.devices else f.environment.get("device") or f.case.device
        rows.append(f"| [`{sig}`]({sig}.json) | {kind} | `{f.root_cause or '?'}` | {f.environment.get('torch', '?')}, "
                    f"{where} | {f.case.world_size} | {f.diagnosis} |")
    return "\n".join(rows)


def cmd_bench(args) -> int:
    from .bench import run_bench

    if args.world_size < 1 or args.cases < 1:
        raise UsageError("--world-size and --cases must be >= 1")
    names = _resolve_targets(args.target)
    if len(names) != 1:
        raise UsageError("bench measures one target at a time")
    models = tuple(_model_families(args.models)) if args.models else ("topologies",)
    if args.soak:
        from .bench import run_soak_bench

        run_soak_bench(parse_duration(args.soak), args.workers, names[0], args.seed)
        return 0
    if args.session:
        from .bench import run_session_bench

        if args.workers < 2:
            raise UsageError("--session needs --workers >= 2 (side by side needs two ranks)")
        run_session_bench(args.cases, args.seed, names[0], worlds=range(1, args.workers + 1))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
        _check_gpus(args, args.world_size)
    if args.scaling:
        from .bench import run_scaling

        run_scaling(args.cases, args.seed, names[0], device=args.device, models=models)
        return 0
    run_bench(args.cases, args.world_size, args.seed, names[0], device=args.device, models=models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
