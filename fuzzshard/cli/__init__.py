"""fuzzshard's command line: the parser and one module a subcommand.

Each subcommand's module (fuzz.py, soak.py, replay.py, ...) has ``add(sub)``, its flags and help, and
``run(args)``; common.py holds what they share.
Exit codes: 0 nothing new found / passes now, 1 findings / still fails, 2 bad usage or input (one clear
line on stderr); replay also 3, fails with another signature.

To add a subcommand: a module here with ``add`` and ``run``, and its name in COMMANDS."""
from __future__ import annotations

import argparse
import sys

from . import bench, bisect, fuzz, known, replay, report, script, show, soak, upstream
from .common import Parser, UsageError, parse_duration, parse_world_sizes  # noqa: F401 (the package's API)
from .known import known_markdown  # noqa: F401 (ci/add_known.py)

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


# in the order --help lists them
COMMANDS = {m.__name__.rsplit(".", 1)[-1]: m for m in (fuzz, soak, report, replay, show, script, upstream, known, bisect, bench)}


class _Version(argparse.Action):
    """``--version``: one line, fuzzshard's version, torch's and python's (torch imported only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import platform

        import torch

        from .. import __version__

        print(f"fuzzshard {__version__}, torch {torch.__version__}, python {platform.python_version()}")
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fuzzshard",
        description="Property-based fuzzing of PyTorch's sharded training stacks: random training setups run "
        "sharded and unsharded on real process groups; divergences shrink to standalone repro scripts.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action=_Version, help="print fuzzshard's, torch's and python's versions and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(sub)
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, whose flags they are not
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    from ..versions import too_old

    if why := too_old():  # below the supported range (fuzzshard/versions.py, docs/versions.md): one line, exit 2
        print(f"fuzzshard: error: {why}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as e:  # one line, named as argparse names its own errors: "fuzzshard fuzz: error: ..."
        print(f"fuzzshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fuzzshard known | head` (an OSError too, so before that one)
        sys.stderr.close()
        return 0
    except OSError as e:  # a path given on the command line that cannot be read or written: one line
        if not e.filename:
            raise
        print(f"fuzzshard {args.command}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fuzzshard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
