"""Helpers more than one oracle's text uses: names made safe for a
signature, where a stuck or dead rank was, numbers and messages shortened."""
from __future__ import annotations

import re

from ..verdict import Verdict


def slug(text: str) -> str:
    """``text`` safe in a signature (and a file name)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def where(verdict: Verdict) -> str:
    """".phase.torch_function" of the lowest rank in ``where`` (the runner's "kernel function:torch
    function"), or "": the phase is the kind of step that rank was in (``phase``, kernel/run.py's _Phase:
    fwdbwd, step, save, load, ...), never fuzzshard's own module or function name, so a signature does not
    move when fuzzshard's code does; a record without it names the torch function alone."""
    at = {str(r): w for r, w in (verdict.extra.get("where") or {}).items()}
    if not at:
        return ""
    r = min(at, key=int)
    phase = {str(k): v for k, v in (verdict.extra.get("phase") or {}).items()}.get(r, "")
    theirs = at[r].rsplit(":", 1)[-1] if ":" in at[r] else ""
    parts = [slug(x) for x in (phase, theirs) if x]
    return "".join(f".{x}" for x in parts if x)


def ranks_finish(verdict: Verdict, actual: str) -> list[str]:
    """Expected/actual of a run that did not finish (a crash, a hang): ``actual`` and the log's tail."""
    log = plain_trace(verdict.error_record.extra.get("log", "")).strip().splitlines()
    return [f"**Expected**: every rank finishes; **actual**: {actual}", ""] + \
        (["```", "\n".join(log[-25:]), "```", ""] if log else [])


def num(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else "?" if x is None else str(x)


def short(text: str, n: int) -> str:
    """``text`` on one line, cut to ``n`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


# ---- an upstream report's words: torch's, not fuzzshard's ----------------

_FUZZSHARD_FRAME = re.compile(r'File "[^"]*fuzzshard/[^"]*"')


def plain_trace(text: str) -> str:
    """A traceback or faulthandler dump as a torch user's would read: the harness's own frames
    (and the code line under each) dropped, torch's paths from torch/ on."""
    out, skip = [], False
    for ln in (text or "").splitlines():
        if skip and ln.startswith("    ") and not ln.lstrip().startswith("File "):
            continue  # the code line under a dropped frame
        skip = bool(_FUZZSHARD_FRAME.search(ln))
        if skip or ln.startswith("Extension modules:"):
            continue
        if "fuzzshard" in ln and not ln.startswith("fuzzshard."):
            continue  # a note about the harness, not a frame
        ln = re.sub(r"^fuzzshard\.[\w.]+\.(\w+: )", r"\1", ln)  # a check of the harness: its class name only
        out.append(re.sub(r'"[^"]*/site-packages/(torch/[^"]*)"', r'"\1"', ln))
    return "\n".join(out)


def torch_calls(verdict: Verdict) -> str:
    """Where the stuck or dead ranks were, as torch calls: "rank 0 in `all_reduce`, rank 1 in `all_gather`"
    (the runner's ``where`` names the harness function too: only the torch one is said)."""
    at = verdict.extra.get("where") or {}
    return ", ".join(f"rank {r} in `{w.rsplit(':', 1)[-1]}`" for r, w in sorted(at.items(), key=lambda x: int(x[0])))


def dtype_of(tolerance: str) -> str:
    """"float32" of a tolerance text ("... 16 ulps of float32"), else ""."""
    m = re.search(r"ulps of (\w+)", tolerance or "")
    return m.group(1) if m else ""


def bound_words(tolerance: str) -> str:
    """A derived tolerance in plain words: what rounding it allows for."""
    dtype = dtype_of(tolerance) or "floating-point"
    m = re.search(r"reductions of length <= (\d+)", tolerance or "")
    return f"{dtype} rounding" + (f" of sums of up to {m.group(1)} terms in another order" if m else "")
