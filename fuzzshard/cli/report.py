"""`fuzzshard report`: a soak's coverage, findings and rate, as text and report.html."""
from __future__ import annotations

import sys

from .common import UsageError


def add(sub) -> None:
    rp = sub.add_parser("report", help="coverage tables, findings and rate of a soak's or a fuzz session's --out; "
                        "writes report.html",
                        description="A soak's or a fuzz session's coverage tables, its findings (new and known apart) "
                        "and its rate, as text, and as an HTML page (DIR/report.html).")
    rp.add_argument("dir", help="a soak's or a fuzz session's --out folder")
    rp.add_argument("--html", default=None, metavar="FILE",
                    help="where to write the HTML page (default DIR/report.html)")


def run(args) -> int:
    from pathlib import Path

    from ..report.page import html_page, summarize, text

    if not Path(args.dir, "cells").is_dir():
        raise UsageError(f"{args.dir} holds no soak or fuzz run (no cells/ folder of per-case lines)")
    s = summarize(args.dir)
    sys.stdout.write(text(s))
    page = Path(args.html or Path(args.dir) / "report.html")
    page.write_text(html_page(s, f"fuzzshard {args.dir}"))
    print(f"\nHTML report: {page}")
    return 0

