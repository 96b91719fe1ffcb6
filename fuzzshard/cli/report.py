"""`fuzzshard report`: a soak's coverage, findings and rate, as text and report.html."""
from __future__ import annotations

import sys

from .common import UsageError


def add(sub) -> None:
    rp = sub.add_parser("report", help="coverage tables, findings and rate of a soak's --out; writes report.html",
                        description="A soak's coverage tables, its findings (new and known apart) and its rate, as "
                        "text, and as an HTML page (DIR/report.html).")
    rp.add_argument("dir", help="a soak's --out folder")
    rp.add_argument("--html", default=None, help="where to write the HTML page (default DIR/report.html)")


def run(args) -> int:
    from pathlib import Path

    from ..report.page import html_page, summarize, text

    if not Path(args.dir, "cells").is_dir():
        raise UsageError(f"{args.dir} holds no soak run (no cells/ folder)")
    s = summarize(args.dir)
    sys.stdout.write(text(s))
    page = Path(args.html or Path(args.dir) / "report.html")
    page.write_text(html_page(s, f"fuzzshard soak {args.dir}"))
    print(f"\nHTML report: {page}")
    return 0

