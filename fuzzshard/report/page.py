"""``fuzzshard report DIR``: what a soak (or any run with cell logs) covered and found.

Reads OUT/cells/*.jsonl (one line per case, see soak.py) and OUT/findings/.
A case that failed is either a hit of a *new* finding (one this run wrote to
OUT/findings/) or a *known* hit (a torch bug in fuzzshard/known/): the two are
counted apart everywhere. Prints the findings grouped by suspected root cause,
the known hits by root cause, coverage tables over the dimensions where bugs
hide (target, world size, optimizer x implementation, param groups, frozen
params, target options, checkpoint kind x world sizes, ...) and the rate over
time; writes the same as an HTML page with three labelled charts (a target x
world-size heat map, new findings over time, cases/s over time).
"""
from __future__ import annotations

import collections
import html
import json
import re
from pathlib import Path

from ..session.caselog import case_line, load_cases, option_tokens  # noqa: F401 (what a session logs)

BUCKETS = 10


def findings_folder(out: str | Path) -> Path:
    """Where a run's finding files are: a soak's OUT/findings/, a fuzz session's OUT itself."""
    return Path(out, "findings") if Path(out, "findings").is_dir() else Path(out)


def load_findings(out: str | Path, matcher=None) -> list[dict]:
    """This run's findings, each with its suspected root cause (or address) as ``group``
    (``matcher``: a rootcause.Matcher over the known findings; built here if not given)."""
    from ..findings.record import Finding, load_known
    from ..findings.rootcause import Matcher

    matcher = matcher or Matcher(load_known())
    found = []
    for p in sorted(findings_folder(out).glob("*.json")):
        try:
            data = json.loads(p.read_text())
            f = Finding.from_dict(data)
            group, said = matcher.group(f.case, f.verdict), f.summary  # (its verdict's words, not a stored copy)
        except Exception:  # a file another tool wrote, or a case from an older fuzzshard: listed, not grouped
            data, group = (data if isinstance(data, dict) else {}), "(unreadable)"
            said = data.get("summary", "")
        found.append({"signature": data.get("signature", p.stem), "summary": said,
                      "origin": (data.get("environment") or {}).get("origin", {}), "file": p.name,
                      "deterministic": data.get("deterministic", True), "group": group})
    return found


OUTCOMES = ("pass", "invalid", "new finding", "known hit", "error")


def _outcome(case: dict, new: set) -> str:
    status = case.get("status") or "?"
    if status != "finding":
        return status
    return "new finding" if case.get("sig") in new or not case.get("known") else "known hit"


# the coverage tables: title -> the rows a case counts in
TABLES = {
    "target": lambda c: [c.get("target")],
    "world size": lambda c: [c.get("world")],
    "optimizer": lambda c: [c.get("optim")],
    "optimizer x implementation": lambda c: [f"{c.get('optim')} {c.get('impl', '?')}"],
    "dtype": lambda c: [c.get("dtype")],
    "param groups": lambda c: [c.get("groups", "?")],
    "frozen params": lambda c: ["some" if c.get("frozen") else "none"] if "frozen" in c else ["?"],
    "target options": lambda c: [f"{c.get('target')}: {t}" for t in c.get("options", ["?"])],
    "checkpoint kind": lambda c: [c.get("ck") or "none"],
    "checkpoint kind x world sizes (saved -> loaded)":
        lambda c: [f"{c['ck']} W{c.get('world')} -> W{c.get('ck_world')}"] if c.get("ck") else [],
    "training loop": lambda c: c.get("loop") or ["none"],  # clip, LR scheduler, grad scaler, async save
    "steps": lambda c: [c.get("steps", "?")],
    "mesh dims": lambda c: [c.get("mesh")],
    "processes in the cell": lambda c: [c.get("procs", 1)],
}


def summarize(out: str | Path) -> dict:
    from ..findings.record import load_known
    from ..findings.rootcause import Matcher

    known = load_known()
    matcher = Matcher(known)  # the known findings' root causes, read once
    cases = load_cases(out)
    findings = load_findings(out, matcher)
    if not cases:
        return {"cases": 0, "findings": findings, "tables": {}, "rate": [], "hits": {}, "groups": {}, "known": []}
    new = {f["signature"] for f in findings}
    for c in cases:
        c["outcome"] = _outcome(c, new)
    t0, t1 = cases[0]["t"], cases[-1]["t"]
    span = max(t1 - t0, 1e-9)
    tables = {}
    for title, rows_of in TABLES.items():
        rows = collections.defaultdict(collections.Counter)
        for c in cases:
            for row in rows_of(c):
                rows[str(row)][c["outcome"]] += 1
        if rows:
            tables[title] = dict(sorted(rows.items(), key=lambda kv: _natural(kv[0])))
    hits = collections.Counter(c["sig"] for c in cases if c.get("sig"))
    first = {}
    for c in cases:
        if c.get("sig") in new and c["sig"] not in first:
            first[c["sig"]] = (c["t"] - t0, c["cell"])
    for f in findings:
        f["count"] = hits.get(f["signature"], 0)
        f["first_seen"], f["cell"] = first.get(f["signature"], (None, f["origin"].get("cell", "?")))
    groups: dict[str, list] = {}
    for f in sorted(findings, key=lambda f: (f["first_seen"] is None, f["first_seen"] or 0)):
        groups.setdefault(f["group"], []).append(f)
    causes = matcher.causes
    by_cause: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in cases:
        if c["outcome"] == "known hit" and c.get("sig"):
            by_cause[known[c["sig"]].root_cause if c["sig"] in known else ""][c["sig"]] += 1
    known_rows = [{"id": rid or "(no root cause recorded)", "hits": sum(n.values()), "signatures": dict(n),
                   "title": causes[rid].title if rid in causes else "", "what": causes[rid].what if rid in causes else "",
                   "upstream": causes[rid].upstream_text
                   if rid in causes else ""} for rid, n in sorted(by_cause.items(), key=lambda kv: -sum(kv[1].values()))]
    rate = []
    for b in range(BUCKETS):
        lo, hi = t0 + span * b / BUCKETS, t0 + span * (b + 1) / BUCKETS
        n = sum(1 for c in cases if lo <= c["t"] < hi or (b == BUCKETS - 1 and c["t"] == hi))
        rate.append((round(lo - t0, 1), n / (span / BUCKETS)))
    heat = collections.Counter((c["target"], c["world"]) for c in cases)
    return {"cases": len(cases), "span": span, "rate": rate, "tables": tables, "findings": findings, "groups": groups,
            "hits": hits, "heat": heat, "firsts": sorted(t for t, _ in first.values()),
            "cells": len({c["cell"] for c in cases}), "known": known_rows,
            "known_hits": sum(1 for c in cases if c["outcome"] == "known hit")}


def _natural(key: str):
    """Numbers in order (W2 before W10), then text."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", key)]


def _n(count: int, noun: str) -> str:
    """"1 suspected bug", "2 suspected bugs"."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def headline(s: dict) -> str:
    return (f"{_n(s['cases'], 'case')} in {s['span'] / 60:.1f} min over {_n(s['cells'], 'cell run')} "
            f"({s['cases'] / s['span']:.2f} cases/s, first case to last) · {_n(len(s['findings']), 'new finding')} "
            f"in {_n(len(s['groups']), 'suspected bug')} · {_n(s['known_hits'], 'known-bug hit')} in "
            f"{_n(len(s['known']), 'root cause')}")


def text(summary: dict) -> str:
    if not summary["cases"]:
        return "no cases recorded yet (OUT/cells/*.jsonl is empty)\n"
    s = summary
    lines = [headline(s), "", "new findings by suspected root cause (first seen: minutes into the run)"]
    for group, fs in s["groups"].items():
        lines.append(f"  {group}: {len(fs)} finding(s)")
        for f in fs:
            when = f"{f['first_seen'] / 60:6.1f}" if f["first_seen"] is not None else "     ?"
            lines.append(f"    {when}  x{f['count']:<4} {f['signature']}  [{f['cell']}]  {clip(f['summary'], 100)}")
    if not s["groups"]:
        lines.append("  none")
    lines += ["", "known torch bugs hit, by root cause"]
    for k in s["known"]:
        lines.append(f"  x{k['hits']:<5} {k['id']}  [{k['upstream']}]  ({len(k['signatures'])} signatures)")
    if not s["known"]:
        lines.append("  none")
    lines.append("")
    for title, rows in s["tables"].items():
        width = max(14, max(len(r) for r in rows) + 2)
        lines.append(f"{title}")
        lines.append(" " * width + "".join(f"{h:>12}" for h in ("cases",) + OUTCOMES))
        for name, counts in rows.items():
            lines.append(f"  {name:<{width - 2}}" + f"{sum(counts.values()):>12}"
                         + "".join(f"{counts.get(h, 0):>12}" for h in OUTCOMES))
        lines.append("")
    lines += ["cases/s over time (seconds into the run)"]
    top = max(r for _, r in s["rate"]) or 1.0
    lines += [f"  +{t:>7.0f}s  {r:6.2f}  {'#' * round(20 * r / top)}" for t, r in s["rate"]]
    return "\n".join(lines) + "\n"


def clip(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters at a word boundary, with an ellipsis where it was cut."""
    if len(text) <= n:
        return text
    cut = text[:n - 1].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + "…"


def linked(upstream: str) -> str:
    """An upstream state with its issue or PR linked ("pytorch/pytorch#186129 (open)"), HTML-escaped."""
    # owner/repo#N, or a bare #N (PyTorch's own, as by-design notes write them)
    return re.sub(r"(?<![\w/&])([\w.-]+/[\w.-]+)?#(\d+)\b",
                  lambda m: f"<a href='https://github.com/{m[1] or 'pytorch/pytorch'}/issues/{m[2]}'>{m[0]}</a>",
                  html.escape(upstream))


def html_page(summary: dict, title: str) -> str:
    s = summary
    esc = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>{esc(title)}</title>",
             "<style>body{font:14px sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right;vertical-align:top}"
             "td:first-child,th:first-child,td.t,th.t{text-align:left}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em;width:100%}"
             "tr:nth-child(even){background:#f4f4f4}.new{color:#b00}.known{color:#666}"
             ".charts{display:flex;flex-wrap:wrap;gap:2em}</style>",
             f"<h1>{esc(title)}</h1>"]
    if not s["cases"]:
        return "\n".join(parts + ["<p>no cases recorded yet (OUT/cells/*.jsonl is empty)</p>"]) + "\n"
    parts.append(f"<p><b>{esc(headline(s))}</b></p>")
    parts.append("<h2 class='new'>New findings, by suspected root cause</h2>")
    if not s["groups"]:
        parts.append("<p>none</p>")
    for group, fs in s["groups"].items():
        parts.append(f"<h3>{esc(group)}: {len(fs)} finding(s)</h3><table><tr><th>signature</th>"
                     "<th>first seen (min)</th><th>hits</th><th>cell</th><th class='t'>summary</th></tr>")
        for f in fs:
            when = f"{f['first_seen'] / 60:.1f}" if f.get("first_seen") is not None else "?"
            parts.append(f"<tr><td><a href='findings/{esc(f['file'])}'>{esc(f['signature'])}</a></td><td>{when}</td>"
                         f"<td>{f.get('count', 0)}</td><td>{esc(str(f.get('cell', '')))}</td>"
                         f"<td class='t' title='{esc(f['summary'])}'>{esc(clip(f['summary'], 240))}</td></tr>")
        parts.append("</table>")
    parts.append("<h2 class='known'>Known torch bugs hit, by root cause</h2>")
    if s["known"]:
        parts.append("<table><tr><th>root cause</th><th>hits</th><th class='t'>upstream</th><th class='t'>signatures</th>"
                     "<th class='t'>what</th></tr>")
        for k in s["known"]:
            sigs = ", ".join(f"{esc(sig)} ×{n}" for sig, n in sorted(k["signatures"].items()))
            parts.append(f"<tr><td>{esc(k['id'])}</td><td>{k['hits']}</td><td class='t'>{linked(k['upstream'])}</td>"
                         f"<td class='t'>{sigs}</td><td class='t' title='{esc(k['what'] or k['title'])}'>{esc(k['title'])}"
                         "</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>none</p>")
    parts += ["<h2>Search</h2><div class='charts'>",
              "<figure>" + _heatmap(s["heat"]) + "<figcaption>cases per target and world size</figcaption></figure>",
              "<figure>" + _timeline(s) + "<figcaption>new findings (distinct signatures) by when first seen; "
              "known-bug hits are not counted</figcaption></figure>",
              "<figure>" + _rate(s) + "<figcaption>cases/s over the run</figcaption></figure></div>"]
    parts.append("<h2>Coverage</h2><p>Cases per value of each dimension, by outcome (<span class='new'>new finding"
                 "</span>: a hit of a finding this run wrote; <span class='known'>known hit</span>: a torch bug in "
                 "fuzzshard/known/).</p>")
    parts.append("<div class='charts'>")
    for name, rows in s["tables"].items():
        parts.append(f"<div><h3>{esc(name)}</h3><table><tr><th></th><th>cases</th>"
                     + "".join(f"<th>{esc(h)}</th>" for h in OUTCOMES) + "</tr>")
        for k, c in rows.items():
            parts.append(f"<tr><td>{esc(k)}</td><td>{sum(c.values())}</td>"
                         + "".join(f"<td>{c.get(h, 0)}</td>" for h in OUTCOMES) + "</tr>")
        parts.append("</table></div>")
    parts.append("</div>")
    return "\n".join(parts) + "\n"


def _heatmap(heat: collections.Counter) -> str:
    targets = sorted({t for t, _ in heat})
    worlds = sorted({w for _, w in heat})
    top = max(heat.values())
    cell, left, top_pad = 56, 130, 40
    width, height = left + cell * len(worlds) + 10, top_pad + cell * len(targets) + 10
    out = [f"<svg width='{width}' height='{height}' font-size='12'>",
           f"<text x='{left + cell * len(worlds) / 2}' y='12' text-anchor='middle' font-weight='bold'>world size</text>",
           f"<text x='12' y='{top_pad + cell * len(targets) / 2}' text-anchor='middle' font-weight='bold' "
           f"transform='rotate(-90 12 {top_pad + cell * len(targets) / 2})'>target</text>"]
    for j, w in enumerate(worlds):
        out.append(f"<text x='{left + j * cell + cell / 2}' y='{top_pad - 6}' text-anchor='middle'>{w}</text>")
    for i, t in enumerate(targets):
        y = top_pad + i * cell
        out.append(f"<text x='{left - 6}' y='{y + cell / 2}' text-anchor='end'>{html.escape(t)}</text>")
        for j, w in enumerate(worlds):
            n = heat.get((t, w), 0)
            shade = int(255 - 200 * n / top)
            out.append(f"<rect x='{left + j * cell}' y='{y}' width='{cell - 2}' height='{cell - 2}' "
                       f"fill='rgb({shade},{shade},255)'/><text x='{left + j * cell + cell / 2}' y='{y + cell / 2}' "
                       f"text-anchor='middle'>{n}</text>")
    return "".join(out) + "</svg>"


def _axes(w: int, h: int, x_label: str, y_label: str, x_max: str, y_max: str) -> str:
    """Both axes of a chart with its plot area in x 50..w-10, y 20..h-40: lines, end values, labels."""
    return (f"<line x1='50' y1='{h - 40}' x2='{w - 10}' y2='{h - 40}' stroke='#000'/>"
            f"<line x1='50' y1='20' x2='50' y2='{h - 40}' stroke='#000'/>"
            f"<text x='50' y='{h - 26}' text-anchor='middle'>0</text>"
            f"<text x='{w - 10}' y='{h - 26}' text-anchor='end'>{x_max}</text>"
            f"<text x='44' y='{h - 40}' text-anchor='end'>0</text><text x='44' y='26' text-anchor='end'>{y_max}</text>"
            f"<text x='{(w + 40) / 2}' y='{h - 8}' text-anchor='middle' font-weight='bold'>{x_label}</text>"
            f"<text x='14' y='{(h - 20) / 2}' text-anchor='middle' font-weight='bold' "
            f"transform='rotate(-90 14 {(h - 20) / 2})'>{y_label}</text>")


def _timeline(s: dict) -> str:
    """New findings (distinct signatures this run wrote) by when first seen."""
    firsts = s["firsts"]
    w, h, span = 420, 220, s["span"]
    pts = [(0, 0)] + [p for i, t in enumerate(firsts) for p in ((t, i), (t, i + 1))] + [(span, len(firsts))]  # steps
    top = max(1, len(firsts))
    xy = " ".join(f"{50 + (w - 60) * t / span:.1f},{h - 40 - (h - 60) * n / top:.1f}" for t, n in pts)
    return (f"<svg width='{w}' height='{h}' font-size='12'>"
            + _axes(w, h, "minutes into the run", "new findings", f"{span / 60:.1f}", str(top))
            + f"<polyline fill='none' stroke='#b00' stroke-width='2' points='{xy}'/></svg>")


def _rate(s: dict) -> str:
    """Cases/s in each tenth of the run, as bars."""
    w, h, span = 420, 220, s["span"]
    top = max((r for _, r in s["rate"]), default=0) or 1.0
    bar = (w - 60) / max(1, len(s["rate"]))
    bars = "".join(f"<rect x='{50 + i * bar + 1:.1f}' y='{h - 40 - (h - 60) * r / top:.1f}' width='{bar - 2:.1f}' "
                   f"height='{(h - 60) * r / top:.1f}' fill='#57a'/>" for i, (_, r) in enumerate(s["rate"]))
    return (f"<svg width='{w}' height='{h}' font-size='12'>"
            + _axes(w, h, "minutes into the run", "cases/s", f"{span / 60:.1f}", f"{top:.2f}") + bars + "</svg>")
