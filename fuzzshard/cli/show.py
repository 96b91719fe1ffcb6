"""`fuzzshard show`: a finding or case file as a person reads it."""
from __future__ import annotations

from .common import FILE_HELP, load_file


def add(sub) -> None:
    s = sub.add_parser("show", help="print a finding or case file readably",
                       description="A finding or case file as a person reads it: the target, world size and mesh, the "
                       "model layer by layer, the optimizer and its groups, the schedule, the checkpoint, the options.")
    s.add_argument("file", help=FILE_HELP)


def run(args) -> int:
    from ..report.show import render

    print(render(load_file(args.file)))
    return 0

