"""`fuzzshard upstream`: an issue-ready report for pytorch/pytorch."""
from __future__ import annotations

import sys

from .common import FILE_HELP, UsageError, load_file


def add(sub) -> None:
    up = sub.add_parser("upstream", help="write an issue-ready report of a finding for pytorch/pytorch",
                        description="An issue for pytorch/pytorch from a finding: a title in PyTorch's style, the "
                        "hand-reduced script of its root cause where known/minimal/ has one, else the straight-line "
                        "script generated from the case (the flattened one, attached, where it cannot be written), "
                        "what it prints here as the evidence, expected vs actual from that output, the torch source "
                        "suspected, and versions (torch.utils.collect_env).")
    up.add_argument("file", help=FILE_HELP)
    up.add_argument("-o", "--output", metavar="FILE",
                    help="write the markdown here (a script too long for an issue body is written beside it, its suffix "
                         ".repro.py); default: standard output, the script into the current folder")
    up.add_argument("--no-run", action="store_true", help="do not run the script (nor collect_env) first")


def run(args) -> int:
    from pathlib import Path

    from ..findings.record import load_known
    from ..report.upstream import report

    finding = load_file(args.file)
    if finding.verdict is None:  # an issue says what failed: a bare case has not failed yet
        raise UsageError(f"{args.file} is a case without a verdict: `fuzzshard replay {args.file}` runs it; "
                         "upstream takes the finding file a failing session or replay writes")
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

