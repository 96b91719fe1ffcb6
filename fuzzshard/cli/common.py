"""What the subcommands share: the usage error, flag groups and their checks, the pool, finding files."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .. import duration
from ..pool.options import CASE_TIMEOUT as DEFAULT_CASE_TIMEOUT


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line and exit 2, as every other usage error is
    ("fuzzshard fuzz: error: --max-examples: 'x' is not a whole number"), not the whole usage block;
    --help still prints it all. The subcommands' parsers are made of this class too."""

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", lambda m: m.group(1).split("/")[-1] + ": ", message)
        if message.startswith(("the following arguments are required", "unrecognized arguments")):
            message += f" (`{self.prog} --help` lists them)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole(text: str) -> int:
    """A flag's whole-number value (argparse's type=): one line naming the flag where it is not one."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def count(text: str) -> int:
    """A flag's count: a whole number >= 1."""
    n = whole(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return n


class Renamed(argparse.Action):
    """An old spelling of a flag, still accepted: it stores into the new one's
    place and says once, in one line, what the flag is called now."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"fuzzshard: note: {option_string} is now {self.new} (the old spelling still works)", file=sys.stderr)
        setattr(namespace, self.dest, values)


FILE_HELP = "a finding file (OUT/<signature>.json) or a bare case JSON"


def parse_duration(text: str, flag: str = "") -> float:
    """A duration (90s, 10m, 8h, 1d; a bare number is seconds) in seconds (fuzzshard/duration.py); ``flag``
    names it in the usage error."""
    try:
        return duration.parse_duration(text, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None


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


# the defaults of flags a mode may default otherwise (fuzz --simulate): the flag's default is None (not given)
WORLD_SIZES = "1,2,3,4"
CASE_TIMEOUT = f"{DEFAULT_CASE_TIMEOUT:g}s"  # (pool/options.py says it)


def draw_args(p) -> None:
    """fuzz's and soak's draw flags, each said once, beside its field (session/options.py Draws)."""
    from ..session.options import flags

    for f in flags():  # an opt-in is read into its field by name (draws)
        p.add_argument(f.metadata["flag"], **f.metadata["argparse"], **({} if f.metadata["parsed"] else {"dest": f.name}))


def pool_args(p, runs: str = "drawn") -> None:
    """The worker pool's flags. ``runs``: what the command runs, for the help that depends on it: "drawn"
    (fuzz, soak: cases drawn), "recorded" (replay, bisect: a file's case), "known" (known --check)."""
    device = {"drawn": "where the ranks run (default: cpu)",
              "recorded": "where the ranks run (default: the device the case was recorded on)",
              "known": "where the ranks run: the known findings recorded there are checked (default: cpu)"}[runs]
    plugin = {"drawn": "your own optimizer, model or parallelism, from one file (fuzzshard.plugin.optimizer / "
                       ".model / .parallelism; see examples/): drawn beside the built-in ones (a parallelism is "
                       "--target NAME); recorded in each finding, so replay loads it again; may be given more than once",
              "recorded": "a plugin file (fuzzshard.plugin) the case needs, loaded in every worker, beside the "
                          "plugins the finding recorded (those load from where they were found); repeatable",
              "known": "a plugin file (fuzzshard.plugin) loaded in every worker before the known findings replay; "
                       "repeatable"}[runs]
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help=device)
    p.add_argument("--backend", default=None, help="process group backend (default: gloo on cpu, nccl on cuda)")
    p.add_argument("--plugin", action="append", default=None, metavar="FILE.py", help=plugin)
    p.add_argument("--worker-setup", default=None, metavar="FILE.py",
                   help="Python file run in every worker before any case: patch torch, register_target(...)")
    p.add_argument("--case-timeout", default=None, metavar="DURATION",
                   help="a case still running after this is a hang finding: 90s, 5m (a bare number is seconds; "
                        f"default {CASE_TIMEOUT})")


def pool_flags(args) -> list[str]:
    """The pool's flags as given (pool_args; --case-timeout once read), again as arguments: what `bisect` hands
    each release's run (cli/release_run.py), so that a new pool flag is said here, beside pool_args, alone."""
    return [f"--case-timeout={args.case_timeout}"] + (["--device", args.device] if args.device else []) \
        + (["--backend", args.backend] if args.backend else []) \
        + [f"--plugin={p}" for p in args.plugin or []] \
        + ([f"--worker-setup={args.worker_setup}"] if args.worker_setup else [])


def out_dir(path: str) -> None:
    """--out made (or there already), or one clear line: under a regular file, not writable, ..."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise UsageError(f"--out {path}: cannot make or write that folder ({e.strerror})") from None


def warn_cores(ranks: int) -> None:
    """More ranks than cores runs (each rank is a process), slowly: said once, not refused."""
    cores = os.cpu_count() or 1
    if ranks > cores:
        print(f"fuzzshard: note: {ranks} ranks on {cores} CPU core(s): each rank is a process, so cases of that size "
              f"run slowly here and may reach --case-timeout", file=sys.stderr)


def case_timeout(args) -> float:
    """``--case-timeout`` read as a duration like every other (90s, 5m; a bare number is seconds), in seconds."""
    seconds = parse_duration(str(CASE_TIMEOUT if args.case_timeout is None else args.case_timeout), "--case-timeout")
    if seconds <= 0:
        raise UsageError("--case-timeout must be positive")
    args.case_timeout = seconds
    return seconds


def check_pool_args(args, device: str | None = None) -> None:
    args.device = args.device or device or "cpu"
    # the plugins first, then --worker-setup (which may patch what a plugin brings): each runs in every worker
    args.setups = [os.path.abspath(p) for p in (args.plugin or []) + [args.worker_setup] if p]
    for flag, path in [("--plugin", p) for p in args.plugin or []] + [("--worker-setup", args.worker_setup)]:
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag}: no such file {path!r}")
    case_timeout(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
        if (args.backend or "nccl") == "gloo":
            raise UsageError("--device cuda runs on NCCL: gloo with CUDA tensors fails in collectives fuzzshard's "
                             "targets use ('writev ... Bad address'), so it is no stand-in for several GPUs")
    for path in args.setups:  # the same files run here, so their registrations are seen by the strategies
        run_setup(path)


_RUN: set = set()  # the setup files run in this process already (a finding's plugin is also a --plugin of replay)


def run_setup(path: str) -> None:
    """A --plugin or --worker-setup file, run in this process (once)."""
    from ..pool.worker import run_setup_file

    if os.path.abspath(path) in _RUN:
        return
    _RUN.add(os.path.abspath(path))
    try:
        run_setup_file(path)
    except Exception as e:
        raise UsageError(f"{path} failed: {type(e).__name__}: {e}") from None


def recorded_plugins(environment, given=()) -> list[str]:
    """The --plugin files a finding's environment records that are still
    here, less those ``given`` on the command line."""
    plugins = environment.get("plugins") if isinstance(environment, dict) else None
    given = {os.path.abspath(p) for p in given}
    return [p for p in plugins or [] if isinstance(p, str) and os.path.isfile(p) and p not in given]


def pool_options(args):
    """The pool's flags (pool_args, once check_pool_args has read them) as the typed record a pool is
    made from (pool/options.py)."""
    from ..pool.options import PoolOptions

    return PoolOptions(device=args.device, backend=args.backend, setup=tuple(args.setups),
                       case_timeout=args.case_timeout, simulate=getattr(args, "simulate", False))


def start_pool(args, size: int, log_dir=None, spare: bool = False, placed: bool = False):
    """``spare``: keep a warm second set of workers for instant restarts (long sessions);
    ``placed``: run cases side by side (Pool.run_many)."""
    from ..pool.runner import Pool, PoolError

    try:
        return Pool(size, options=pool_options(args), log_dir=log_dir, spare=spare, placed=placed).start()
    except PoolError as e:
        raise UsageError(f"could not start {size} workers: {e}") from None


def resolve_targets(text: str) -> list[str]:
    from .. import targets

    names = targets.names() if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in targets.names()]
    if unknown or not names:
        raise UsageError(f"unknown target {', '.join(unknown) or text!r} (known: {', '.join(targets.names())}, all)")
    return names


def check_gpus(args, ranks: int) -> None:
    """NCCL takes one rank per GPU: more ranks than GPUs is refused up front."""
    if args.device == "cuda":
        import torch

        if ranks > torch.cuda.device_count():
            raise UsageError(f"world size {ranks} needs {ranks} GPUs (NCCL runs one rank per GPU); this machine "
                             f"has {torch.cuda.device_count()}: use --world-sizes up to {torch.cuda.device_count()}")


def redis_url(url: str) -> str:
    try:
        import redis  # noqa: F401
    except ImportError:
        raise UsageError("--redis needs the redis package: pip install 'fuzzshard[redis]'") from None
    if not url.startswith("redis://"):
        raise UsageError(f"--redis takes a redis://host:port/db URL, got {url!r}")
    return url


def draws(args, targets, world_sizes, **more):
    """The draw flags (draw_args) as the typed record a session draws by (session/options.py Draws): those
    whose text is read here, the opt-ins (--ac, --dropout, ...) as they are; ``more``: what a mode adds."""
    from ..session.options import Draws, flags

    read = {"world_sizes": tuple(world_sizes), "optimizer_names": optimizer_names(args.optimizers),
            "models": tuple(model_families(args.models)) if args.models else None,
            "loop": loop_features(args.loop),
            "checkpoint": {"some": None, "all": True, "none": False}[args.checkpoints]}
    given = {f.name: read[f.name] if f.metadata["parsed"] else bool(getattr(args, f.name)) for f in flags()}
    if given["ao"]:
        from ..kernel.float8 import FLOAT8_OFF, float8_available

        if not float8_available():
            print(FLOAT8_OFF, file=sys.stderr)
            given["ao"] = False
    return Draws(targets=tuple(targets), device=args.device, **given, **more)


def optimizer_names(text: str | None) -> tuple[str, ...] | None:
    """``--optimizers``: torch.optim classes (or a plugin's), comma-separated; None: every one."""
    if not text:
        return None
    from fuzzshard.strategies.optimizers import available

    opts = [o.strip() for o in text.split(",")]
    bad = [o for o in opts if o not in available()]
    if bad:
        raise UsageError(f"unknown optimizer(s) {bad} (known: {', '.join(available())})")
    return tuple(opts)


def loop_features(text: str) -> tuple[str, ...]:
    """``--loop``'s features: all, none, or a comma-separated list of them."""
    from fuzzshard.strategies.loop import FEATURES

    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return FEATURES
    if names == ["none"] or not names:
        return ()
    bad = [n for n in names if n not in FEATURES]
    if bad:
        raise UsageError(f"--loop: unknown feature(s) {bad} (known: {', '.join(FEATURES)}, or all / none)")
    return tuple(names)


def model_families(text: str) -> list[str]:
    from fuzzshard.strategies.models import FAMILIES

    families = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in families if m not in FAMILIES]
    if bad or not families:
        raise UsageError(f"unknown model family {bad or text!r} (known: {', '.join(FAMILIES)})")
    return families


def raw_finding(path) -> dict:
    """A finding file's raw JSON, or {} (``load_file`` then says what is wrong with it)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) and isinstance(data.get("case", {}), dict) else {}
    except (OSError, ValueError):
        return {}


# a finding file's fields besides its case, and what each must be (findings/record.py Finding.from_dict reads them)
_FIELDS = {"signature": str, "verdict": (dict, type(None)), "deterministic": bool, "stage": str, "environment": dict,
           "diagnosis": str, "trigger": dict, "only_when": dict, "devices": list, "root_cause": str, "faces": list,
           "generalization": list, "removed": list, "seen_on": dict, "summary": str}
_JSON = {str: "a string", dict: "an object", list: "a list", bool: "true or false", (dict, type(None)): "an object"}
# the model tree's node kinds (case.py Layer; kernel/model.py builds each) and the checkpoint kinds every
# target's spec lists (Spec.checkpoint_kinds); the clip forms kernel/loop.py runs
LAYER_KINDS = ("linear", "embedding", "layernorm", "conv1d", "act", "dropout", "seq", "residual", "twice", "moe")
CLIP_FORMS = ("norm", "two_part", "value", "own")
CLIP_NORMS = ("1", "2", "3", "inf")


def file_problem(data) -> str | None:
    """What makes a finding file's JSON no finding, in one phrase, before it is read as one; None: nothing.
    (A bare case, a JSON object with "target" and no "case", is a case file: Case.from_dict checks it.)"""
    if not isinstance(data, dict):
        return f"not a fuzzshard finding: a JSON {type(data).__name__}, not an object"
    if "case" not in data:
        return None if "target" in data else "not a fuzzshard finding: no 'case' field"
    if not isinstance(data["case"], dict):
        return "not a fuzzshard finding: its 'case' is not an object"
    for name, kind in _FIELDS.items():
        if name in data and not isinstance(data[name], kind):
            return f"not a fuzzshard finding: its '{name}' is not {_JSON[kind]}"
    if data.get("verdict") and not data.get("signature"):
        return "not a fuzzshard finding: it has a verdict but no 'signature'"
    return None


def case_problem(case) -> str | None:
    """What in a case this fuzzshard cannot run, named (an optimizer, a model kind, a dtype, ... that it does
    not know), or None; after the plugins the finding names are loaded (theirs count as known)."""
    import torch

    from ..kernel.model import BUILTIN_MODELS, USER_MODELS, ACTIVATIONS
    from ..kernel.lowbit import LOWBIT_OPTIMIZERS
    from ..kernel.optim import USER_OPTIMIZERS
    from ..kernel.oracles import UNIT_ROUNDOFF
    from .. import targets

    opt = case.optim.name
    cls = getattr(torch.optim, opt, None)
    if opt not in USER_OPTIMIZERS and opt not in LOWBIT_OPTIMIZERS \
            and not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):  # (torchao's: fsdp2's check)
        from fuzzshard.strategies.optimizers import available

        return f"unknown optimizer {opt!r}: not a torch.optim class nor a plugin's (known: {', '.join(available())})"
    if case.device not in ("cpu", "cuda"):
        return f"unknown device {case.device!r} (known: cpu, cuda)"
    if case.dtype not in UNIT_ROUNDOFF:
        return f"unknown dtype {case.dtype!r} (known: {', '.join(UNIT_ROUNDOFF)})"
    model = case.model
    if model.input not in ("features", "tokens"):
        return f"unknown model input {model.input!r} (known: features, tokens)"
    if model.factory and model.factory not in BUILTIN_MODELS and model.factory not in USER_MODELS:
        return (f"unknown model {model.factory!r}: not a built-in one ({', '.join(BUILTIN_MODELS)}) nor a plugin's "
                f"(--plugin FILE.py loads it)")

    def walk(layers, where):
        for i, layer in enumerate(layers):
            at = f"{where}.{i}"
            if layer.kind not in LAYER_KINDS:
                return f"unknown model kind {layer.kind!r} at {at} (known: {', '.join(LAYER_KINDS)})"
            if layer.kind == "act" and layer.act not in ACTIVATIONS:
                return f"unknown activation {layer.act!r} at {at} (known: {', '.join(ACTIVATIONS)})"
            bad = walk(layer.children, at)
            if bad:
                return bad
        return None

    bad = walk(model.layers, "layers")
    if bad:
        return bad
    schedulers = [case.lr_scheduler] if case.lr_scheduler else []
    while schedulers:
        sched = schedulers.pop()
        cls = getattr(torch.optim.lr_scheduler, sched.name, None)
        if not (isinstance(cls, type) and sched.name[0].isupper()):
            return f"unknown LR scheduler {sched.name!r}: torch.optim.lr_scheduler has no such class"
        schedulers += sched.children
    if case.clip and case.clip.how not in CLIP_FORMS:
        return f"unknown clip {case.clip.how!r} (known: {', '.join(CLIP_FORMS)})"
    if case.clip and case.clip.norm_type not in CLIP_NORMS:
        return f"unknown clip norm type {case.clip.norm_type!r} (known: {', '.join(CLIP_NORMS)})"
    kinds = targets.get(case.target).spec.checkpoint_kinds
    if case.checkpoint and case.checkpoint.kind not in kinds:
        return (f"unknown checkpoint kind {case.checkpoint.kind!r} for {case.target} (known: "
                f"{', '.join(kinds) or 'none: it takes no checkpoint'})")
    return None


def load_file(path):
    """A finding or case file, checked: one clear line (UsageError) where it cannot be read, is no finding, or
    names what this fuzzshard does not know (an optimizer, a target, a model kind, ...), never a traceback or
    a quiet fallback script."""
    from ..case import CaseError
    from ..findings.record import load_finding

    def said(e) -> str:  # the path once: a message that names it already is not prefixed again
        text = str(e)
        return text if str(path) in text else f"{path}: {text}"

    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = None  # load_finding says what is wrong with it
    problem = file_problem(raw) if raw is not None else None
    if problem:
        raise UsageError(f"{path}: {problem}")
    try:
        finding = load_finding(path)
    except CaseError as e:
        raise UsageError(said(e)) from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of a type it cannot hold, deeper down
        raise UsageError(f"{path}: not a fuzzshard finding: {type(e).__name__}: {e}") from None
    from .. import targets

    for plugin in recorded_plugins(finding.environment):  # its parallelism, optimizer or model may be a plugin's
        run_setup(plugin)
    env = finding.environment if isinstance(finding.environment, dict) else {}
    gone = [p for p in env.get("plugins") or [] if isinstance(p, str) and not os.path.isfile(p)]
    hint = f" (it was found with plugin file(s) not here: {', '.join(gone)})" if gone else ""
    if finding.case.target not in targets.names():
        raise UsageError(f"{path}: unknown target {finding.case.target!r} (known: {', '.join(targets.names())})"
                         + hint)
    problem = case_problem(finding.case)
    if problem:
        raise UsageError(f"{path}: {problem}{hint}")
    try:
        finding.case.check()
    except CaseError as e:
        raise UsageError(said(e)) from None
    return finding


def torch_version() -> str:
    import torch

    return torch.__version__

