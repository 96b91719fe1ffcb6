#!/usr/bin/env python
"""Rewrite each known finding file's stored "summary" from its own verdict.

The summary is derived (findings/record.py's Finding.summary); the stored copy is only for
someone reading the file, and goes stale when a tool rewrites the case and verdict but not it
(ci/reduce_known.py did, for 31 files). Only that field changes; the file's format is kept.

    python ci/refresh_summaries.py [--known DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fuzzshard.findings.record import KNOWN_DIR, ROOT_CAUSES, load_finding


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--known", default=str(KNOWN_DIR), help="the known-findings folder (default: fuzzshard's)")
    args = ap.parse_args()
    changed = 0
    for path in sorted(Path(args.known).glob("*.json")):
        if path.name == ROOT_CAUSES:
            continue
        text = path.read_text()
        data = json.loads(text)
        fresh = load_finding(path).summary
        if data.get("summary") == fresh:
            continue
        assert json.dumps(data, indent=2, sort_keys=True) + "\n" == text, f"{path.name}: not in the known list's format"
        data["summary"] = fresh
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        changed += 1
        print(f"{path.name}: summary rewritten from its verdict")
    print(f"{changed} summaries rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
