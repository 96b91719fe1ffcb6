"""Helpers more than one oracle's text uses: names made safe for a
signature, where a stuck or dead rank was, numbers and messages shortened."""
from __future__ import annotations

import re


def slug(text: str) -> str:
    """``text`` safe in a signature (and a file name)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def where(verdict: dict) -> str:
    """".kernel_function.torch_function" of the lowest rank in ``where``, or ""."""
    at = verdict.get("where", {})
    first = at.get(min(at), "") if at else ""
    return f".{slug(first.replace(':', '.'))}" if first else ""


def ranks_finish(verdict: dict, actual: str) -> list[str]:
    """Expected/actual of a run that did not finish (a crash, a hang): ``actual`` and the log's tail."""
    err = verdict.get("error") if isinstance(verdict.get("error"), dict) else {}
    log = [x for x in err.get("log", "").strip().splitlines() if not x.startswith("Extension modules:")]
    return [f"**Expected**: every rank finishes; **actual**: {actual}", "", "```", "\n".join(log[-25:]), "```", ""]


def num(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else "?" if x is None else str(x)


def short(text: str, n: int) -> str:
    """``text`` on one line, cut to ``n`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"
