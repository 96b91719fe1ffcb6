"""The writer: every finding file in place, and nothing else writes one.

A finding is OUT/<sig>.json (its record, record.py's Finding) beside OUT/<sig>.py (its standalone script,
``script_of``: repro.py). A session's book (life.py's FindingBook, SoakBook), the real-process check of a
simulated session's findings (life.confirm_on_real, real.py) and the pytest plugin write through here:
``put_finding`` (both files, whole), ``amend_finding`` (fields of a file's record), ``keep_apart`` (a record
kept beside the findings, never one), ``set_apart`` (a finding that is none after all, kept apart),
``drop_finding`` (its files gone)."""
from __future__ import annotations

import json
from pathlib import Path

from . import repro
from .record import Finding, atomic_write, read_record, summary, write_finding


def script_of(f: Finding) -> str:
    """The finding's standalone .py (repro.py)."""
    return repro.script(f.case, summary(f.verdict), f.environment, verdict=f.verdict)


def put_finding(out, f: Finding, simulation: dict | None = None, replace: bool = True) -> tuple[Path, Path]:
    """OUT/<sig>.json + .py of ``f`` (the script: ``script_of``), whatever was there (unless not
    ``replace``: then only over a larger case, record.write_finding); ``simulation``: what a simulated session
    and the real-process check said of it (life.confirm_on_real), in its file. Returns the two paths."""
    out = Path(out)
    paths = write_finding(out, f, script_of(f), replace=replace)
    if simulation is not None:
        amend_finding(out, f.signature, simulation=simulation)
    return paths


def amend_finding(out, sig: str, **fields) -> dict:
    """OUT/<sig>.json with ``fields`` set at its top level (its stage, what a simulated session said of it,
    its faces): the rest of the file as it is. Returns the file's record as written."""
    path = Path(out) / f"{sig}.json"
    data = read_record(out, sig)
    data.update(fields)
    atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def keep_apart(out, folder: str, name: str, record: dict) -> Path:
    """OUT/<folder>/<name>.json: what is kept beside the findings, never one of them (known faces,
    contaminated verdicts, internal errors, a simulated session's LocalTensor limitations)."""
    path = Path(out) / folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return path


def set_apart(out, folder: str, sig: str, record: dict) -> Path:
    """A finding that is none after all, kept apart: ``record`` as OUT/<folder>/<sig>.json, its script
    moved beside it, its files in OUT gone."""
    import shutil

    out = Path(out)
    path = keep_apart(out, folder, sig, record)
    if (out / f"{sig}.py").exists():
        shutil.move(out / f"{sig}.py", path.parent / f"{sig}.py")
    drop_finding(out, sig)
    return path


def drop_finding(out, sig: str) -> None:
    """OUT/<sig>.json and .py gone (a finding folded into another, or none after all)."""
    for suffix in (".json", ".py"):
        (Path(out) / f"{sig}{suffix}").unlink(missing_ok=True)
