"""``fuzzshard report DIR``: what a soak (or any run with cell logs) covered and found.

Reads OUT/cells/*.jsonl (one line per case, see soak.py) and OUT/findings/.
Prints coverage tables (cases per target, world size, optimizer, dtype,
checkpoint kind, processes a cell spans), the findings with first-seen time and hit count, and the
rate over time; writes the same as a small HTML page with two plots (a
target x world-size coverage heat map, findings over time).
"""
from __future__ import annotations

import collections
import html
import json
from pathlib import Path

BUCKETS = 10


def load_cases(out: str | Path, prefix: str = "") -> list[dict]:
    """Every case line of every cell; a line cut short by a kill is skipped."""
    cases = []
    for p in sorted(Path(out, "cells").glob(f"{prefix}*.jsonl")):
        cell = p.stem
        with open(p, errors="replace") as f:
            for line in f:
                try:
                    c = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(c, dict) and "t" in c:
                    c["cell"] = cell
                    cases.append(c)
    cases.sort(key=lambda c: c["t"])
    return cases


def load_findings(out: str | Path) -> list[dict]:
    found = []
    for p in sorted(Path(out, "findings").glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found.append({"signature": data.get("signature", p.stem), "summary": data.get("summary", ""),
                      "origin": data.get("environment", {}).get("origin", {}), "file": p.name,
                      "deterministic": data.get("deterministic", True)})
    return found


def summarize(out: str | Path) -> dict:
    cases = load_cases(out)
    findings = load_findings(out)
    if not cases:
        return {"cases": 0, "findings": findings, "tables": {}, "rate": [], "hits": {}}
    t0, t1 = cases[0]["t"], cases[-1]["t"]
    span = max(t1 - t0, 1e-9)
    tables = {}
    for key, title in (("target", "target"), ("world", "world size"), ("optim", "optimizer"), ("dtype", "dtype"),
                       ("ck", "checkpoint"), ("mesh", "mesh dims"), ("procs", "processes in the cell")):
        rows = collections.defaultdict(collections.Counter)
        for c in cases:
            rows[str(c.get(key, 1 if key == "procs" else None))][c.get("status") or "?"] += 1
        tables[title] = dict(sorted(rows.items()))
    hits = collections.Counter(c["sig"] for c in cases if c.get("sig"))
    first = {}
    for c in cases:
        if c.get("sig") and c["sig"] not in first:
            first[c["sig"]] = (c["t"] - t0, c["cell"])
    for f in findings:
        f["count"] = hits.get(f["signature"], 0)
        f["first_seen"], f["cell"] = first.get(f["signature"], (None, f["origin"].get("cell", "?")))
    rate = []
    for b in range(BUCKETS):
        lo, hi = t0 + span * b / BUCKETS, t0 + span * (b + 1) / BUCKETS
        n = sum(1 for c in cases if lo <= c["t"] < hi or (b == BUCKETS - 1 and c["t"] == hi))
        rate.append((round(lo - t0, 1), n / (span / BUCKETS)))
    heat = collections.Counter((c["target"], c["world"]) for c in cases)
    return {"cases": len(cases), "span": span, "rate": rate, "tables": tables, "findings": findings,
            "hits": hits, "heat": heat, "firsts": sorted(t for t, _ in first.values()), "cells": len({c["cell"] for c in cases}),
            "known_hits": sum(1 for c in cases if c.get("known"))}


def text(summary: dict) -> str:
    if not summary["cases"]:
        return "no cases recorded yet (OUT/cells/*.jsonl is empty)\n"
    s = summary
    lines = [f"{s['cases']} cases in {s['span'] / 60:.1f} min over {s['cells']} cell runs "
             f"({s['cases'] / s['span']:.2f} cases/s) · {len(s['findings'])} findings · {s['known_hits']} known-bug hits", ""]
    statuses = ["pass", "invalid", "finding", "error"]
    for title, rows in s["tables"].items():
        lines.append(f"{title:<14}" + "".join(f"{h:>9}" for h in ["cases"] + statuses))
        for name, counts in rows.items():
            lines.append(f"  {name:<12}" + f"{sum(counts.values()):>9}" + "".join(f"{counts.get(h, 0):>9}" for h in statuses))
        lines.append("")
    lines.append("findings (first seen: minutes into the run)")
    for f in s["findings"]:
        when = f"{f['first_seen'] / 60:6.1f}" if f["first_seen"] is not None else "     ?"
        lines.append(f"  {when}  x{f['count']:<4} {f['signature']}  [{f['cell']}]  {f['summary'][:100]}")
    if not s["findings"]:
        lines.append("  none")
    lines += ["", "cases/s over time"]
    top = max(r for _, r in s["rate"]) or 1.0
    lines += [f"  +{t:>7.0f}s  {r:6.2f}  {'#' * round(20 * r / top)}" for t, r in s["rate"]]
    return "\n".join(lines) + "\n"


def html_page(summary: dict, title: str) -> str:
    s = summary
    esc = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>{esc(title)}</title>",
             "<style>body{font:14px sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}table{border-collapse:collapse;margin:1em 0}"
             "tr:nth-child(even){background:#f4f4f4}</style>",
             f"<h1>{esc(title)}</h1><pre>{esc(text(s).split(chr(10))[0])}</pre>"]
    if s["cases"]:
        parts += ["<h2>Coverage: cases per target and world size</h2>", _heatmap(s["heat"]),
                  "<h2>Findings over time</h2>", _timeline(s)]
        for name, rows in s["tables"].items():
            parts.append(f"<h3>{esc(name)}</h3><table><tr><th></th><th>cases</th><th>pass</th><th>invalid</th>"
                         "<th>finding</th><th>error</th></tr>")
            for k, c in rows.items():
                parts.append(f"<tr><td>{esc(k)}</td><td>{sum(c.values())}</td>"
                             + "".join(f"<td>{c.get(h, 0)}</td>" for h in ("pass", "invalid", "finding", "error")) + "</tr>")
            parts.append("</table>")
    parts.append("<h2>Findings</h2><table><tr><th>signature</th><th>first seen (min)</th><th>hits</th><th>cell</th><th>summary</th></tr>")
    for f in s["findings"]:
        when = f"{f['first_seen'] / 60:.1f}" if f.get("first_seen") is not None else "?"
        parts.append(f"<tr><td><a href='findings/{esc(f['file'])}'>{esc(f['signature'])}</a></td><td>{when}</td>"
                     f"<td>{f.get('count', 0)}</td><td>{esc(str(f.get('cell', '')))}</td><td>{esc(f['summary'][:160])}</td></tr>")
    parts.append("</table>")
    return "\n".join(parts) + "\n"


def _heatmap(heat: collections.Counter) -> str:
    targets = sorted({t for t, _ in heat})
    worlds = sorted({w for _, w in heat})
    top = max(heat.values())
    cell, left = 56, 110
    out = [f"<svg width='{left + cell * len(worlds) + 10}' height='{30 + cell * len(targets)}' font-size='12'>"]
    for j, w in enumerate(worlds):
        out.append(f"<text x='{left + j * cell + cell / 2}' y='15' text-anchor='middle'>W{w}</text>")
    for i, t in enumerate(targets):
        y = 22 + i * cell
        out.append(f"<text x='{left - 6}' y='{y + cell / 2}' text-anchor='end'>{html.escape(t)}</text>")
        for j, w in enumerate(worlds):
            n = heat.get((t, w), 0)
            shade = int(255 - 200 * n / top)
            out.append(f"<rect x='{left + j * cell}' y='{y}' width='{cell - 2}' height='{cell - 2}' "
                       f"fill='rgb({shade},{shade},255)'/><text x='{left + j * cell + cell / 2}' y='{y + cell / 2}' "
                       f"text-anchor='middle'>{n}</text>")
    return "".join(out) + "</svg>"


def _timeline(s: dict) -> str:
    """Distinct signatures (known torch bugs included) by when first seen."""
    firsts = s["firsts"]
    w, h, span = 600, 160, s["span"]
    pts = [(0, 0)] + [(t, i + 1) for i, t in enumerate(firsts)] + [(span, len(firsts))]
    top = max(1, len(firsts))
    xy = " ".join(f"{40 + (w - 50) * t / span:.1f},{h - 20 - (h - 40) * n / top:.1f}" for t, n in pts)
    return (f"<svg width='{w}' height='{h}' font-size='12'><polyline fill='none' stroke='#c33' stroke-width='2' "
            f"points='{xy}'/><text x='40' y='{h - 4}'>0</text><text x='{w - 10}' y='{h - 4}' text-anchor='end'>"
            f"{span / 60:.1f} min</text><text x='4' y='20'>{top}</text></svg>")
