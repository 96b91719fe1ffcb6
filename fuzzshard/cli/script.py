"""`fuzzshard script`: the standalone torchrun repro of a finding or case."""
from __future__ import annotations

import sys

from .common import FILE_HELP, load_file


def add(sub) -> None:
    sc = sub.add_parser("script", help="write the standalone torchrun repro script of a finding or case file",
                        description="The standalone repro of a finding or case: a torch-only script for `torchrun "
                        "--nproc-per-node W FILE.py` that exits 1 while the bug is there and 0 once it is fixed "
                        "(--setup PATCH.py runs a patch first). Straight-line where the case allows it, else "
                        "fuzzshard's kernel flattened around the case.")
    sc.add_argument("file", help=FILE_HELP)
    sc.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output")
    sc.add_argument("--flat", action="store_true", help="fuzzshard's whole kernel flattened around the case, not the "
                    f"straight-line script of what the case uses (written for {', '.join(written())} cases; one "
                    "that uses what its target's writer does not write gets the flattened one anyway, its header "
                    "says why)")


def written() -> list[str]:
    """The targets the straight-line script is written for: each with a writer, scriptgen/NAME.py (found by its
    file, so that --help imports no torch)."""
    from pathlib import Path

    from ..targets import names

    here = Path(__file__).resolve().parent.parent / "scriptgen"
    return [n for n in names() if (here / f"{n}.py").exists()]


def run(args) -> int:
    from ..findings import repro
    from ..findings.record import summary

    finding = load_file(args.file)
    text = repro.script(finding.case, summary(finding.verdict) if finding.verdict else "", finding.environment,
                        flat=args.flat, verdict=finding.verdict)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0

