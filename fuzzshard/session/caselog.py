"""OUT/cells/*.jsonl: the line a session logs per case run (``case_line``; Session.on_case writes it, a fuzz
session's and each soak cell's) and every line read back (``load_cases``: `fuzzshard report`'s tables,
bench --soak's count). Written here, beside the session, so that report/ reads what session/ writes and
session/ imports nothing of report/."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .schedule import loop_cells


def option_tokens(case) -> list[str]:
    """A case's target options as short "key=value" tokens a coverage table can count (a soak
    logs them per case): scalars as they are, a config dict by its fields (mp.param_dtype=
    bfloat16), a dict keyed by module or param name by the distinct values it maps them to
    (placements=S0, tp=rowwise), a list by whether it is empty (wrap=[] / wrap=[...])."""
    tokens = set()
    for k, v in (case.target_options or {}).items():
        if isinstance(v, (bool, str, int, float)) or v is None:
            tokens.add(f"{k}={v}")
        elif isinstance(v, (list, tuple)):
            tokens.add(f"{k}={'[...]' if v else '[]'}")
        elif isinstance(v, dict) and all("." not in str(sk) for sk in v) and all(
                isinstance(sv, (bool, str, int, float)) or sv is None for sv in v.values()) and k != "tp":
            tokens.update(f"{k}.{sk}={sv}" for sk, sv in v.items())
        elif isinstance(v, dict):
            tokens.update(f"{k}={_compact(sv)}" for sv in v.values())
    return sorted(tokens)


def _compact(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_compact(x) for x in v)
    if isinstance(v, dict):
        return " ".join(f"{k}:{_compact(x)}" for k, x in sorted(v.items()))
    return str(v)


def case_line(case, verdict, sig: str | None, known: bool, procs: int = 1) -> dict:
    """The line a session logs per case run (OUT/cells/*.jsonl), what the tables count."""
    ck = case.checkpoint
    return {"t": round(time.time(), 3), "target": case.target, "world": case.world_size,
            "mesh": len(case.mesh_shape), "ck": ck.kind if ck else None, "ck_world": ck.world_size if ck else None,
            "optim": case.optim.name, "impl": case.optim.implementation, "dtype": case.dtype,
            "steps": len(case.schedule), "options": option_tokens(case), "loop": loop_cells(case),
            "groups": len(case.groups), "frozen": bool(case.frozen), "procs": procs, "status": verdict.status,
            "oracle": verdict.oracle, "sig": sig, "known": known}


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
