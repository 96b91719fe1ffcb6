"""``fuzzshard bench --hunt``: how fast the search reaches each corner.

For each planted bug of a hunt set (tests/planted/hunt.json: the bug's
--worker-setup file, the target and fuzz flags it is hunted with, and the
signature prefix its finding's file starts with), over a few seeds: a timed
``fuzzshard fuzz`` session with the bug planted, and the seconds from the
session's start (its pool started: what its first progress line counts
from) until a file of that finding first appears in its --out (a
provisional hang's counts: it is on disk). The session is then stopped.
The start-up before it (imports, the pool's workers) is the same for every
bug and is shown apart. One table: each seed's time, the median and the
worst per bug, and over all runs. A bug not seen within ``--cap`` seconds
counts as the cap in the median and the worst and is marked ``>cap``.

A benchmark, never a test: the times move with the machine's load, so
compare tables taken one after the other on one machine, and say what else
ran (docs/search.md). Its flags, and ``python -m fuzzshard.cli.hunt`` (the same
without the rest of bench), are cli/hunt.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


DEFAULT_SET = Path(__file__).resolve().parent.parent.parent / "tests" / "planted" / "hunt.json"
DEFAULT_SEEDS = (1, 2, 3)
DEFAULT_CAP = 90.0
POLL = 0.25  # seconds between two looks at a session's --out
_ELAPSED = re.compile(r"^\[fuzzshard\] .* · (\d+):(\d\d)(?::(\d\d))? of ", re.M)


@dataclass(frozen=True)
class Bug:
    name: str
    setup: str  # the --worker-setup file, relative to the set's folder
    target: str
    expect: str | tuple  # the signature prefix of its finding's file (a tuple: any of them)
    corner: str = ""
    flags: tuple = ()  # more `fuzzshard fuzz` arguments
    optimizer: str | None = None  # the finding's case must have it too (a hang's signature names no optimizer)


def load_set(path: str | Path = DEFAULT_SET) -> tuple[Path, list[Bug]]:
    path = Path(path)
    if path == DEFAULT_SET and not path.exists():
        raise ValueError(f"no hunt set at {path}: the default set (tests/planted/hunt.json) and its planted bugs "
                         "come with fuzzshard's source tree, not with an installed package: run from a checkout "
                         "(pip install -e .), or pass --hunt-set FILE.json")
    data = json.loads(path.read_text())
    # expect: a prefix, or a list of them (a planted collective mismatch shows as a hang or as a gloo abort)
    bugs = [Bug(b["name"], b["setup"], b["target"], b["expect"] if isinstance(b["expect"], str) else tuple(b["expect"]),
                b.get("corner", ""), tuple(b.get("flags", ())),
                b.get("optimizer")) for b in data["bugs"]]
    return path.parent, bugs


def pick(bugs: list[Bug], names: str | None) -> list[Bug]:
    """``names``: comma-separated bug names (or prefixes of them); None: all."""
    if not names:
        return bugs
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    out = [b for b in bugs if any(b.name == w or b.name.startswith(w) for w in wanted)]
    missing = [w for w in wanted if not any(b.name == w or b.name.startswith(w) for b in bugs)]
    if missing:
        raise ValueError(f"no planted bug named {', '.join(missing)} in the hunt set (have: "
                         f"{', '.join(b.name for b in bugs)})")
    return out


def first_sight(out: Path, prefix: str, optimizer: str | None = None) -> str | None:
    """The name of a finding file in ``out`` whose signature starts with ``prefix`` (and whose case has
    ``optimizer``, if given: a slow case cut as a provisional hang elsewhere is not the planted hang), if any."""
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return None
    for n in sorted(names):
        if n.endswith(".json") and n.startswith(prefix):
            if optimizer is None:
                return n
            try:
                if json.loads(Path(out, n).read_text())["case"]["optim"]["name"] == optimizer:
                    return n
            except (OSError, ValueError, KeyError):
                pass  # being written
    return None


def session_start(log: Path, now: float) -> float | None:
    """When the session's clock started (monotonic), from its first progress line
    (``[fuzzshard] ... · mm:ss of ...``, printed after its first case), read at ``now``."""
    try:
        m = _ELAPSED.search(log.read_text())
    except OSError:
        return None
    if not m:
        return None
    a, b, c = (int(x) if x else None for x in m.groups())
    elapsed = a * 60 + b if c is None else (a * 60 + b) * 60 + c
    return now - elapsed - 0.5  # the line truncates to whole seconds


def hunt_one(bug: Bug, folder: Path, seed: int, cap: float, python=sys.executable, keep: str | None = None) -> dict:
    """One timed session with ``bug`` planted, stopped at its first sight or at ``cap`` seconds."""
    tmp = tempfile.mkdtemp(prefix=f"fuzzshard-hunt-{bug.name}-{seed}-", dir=keep)
    out = Path(tmp, "out")
    duration = max(240, int(cap) + 60)  # a timed session, as users run them; stopped long before it ends
    cmd = [python, "-m", "fuzzshard", "fuzz", "--target", bug.target, "--duration", f"{duration}s", "--seed", str(seed),
           "--out", str(out), "--worker-setup", str(folder / bug.setup), *bug.flags]
    log = open(Path(tmp, "stderr.txt"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    found = started = None
    try:
        while True:
            now = time.monotonic()
            started = started or session_start(Path(tmp, "stderr.txt"), now)
            found = first_sight(out, bug.expect, bug.optimizer)
            if found or proc.poll() is not None or now - (started or t0) >= cap:
                break
            time.sleep(POLL)
        seconds = now - (started or t0)
        found = found or first_sight(out, bug.expect, bug.optimizer)
    finally:
        _stop(proc)
        log.close()
    stage = None
    if found:
        try:
            stage = json.loads(Path(out, found).read_text()).get("stage")
        except (OSError, ValueError):
            stage = "?"
    others = sorted(n[:-5] for n in os.listdir(out) if n.endswith(".json")) if out.is_dir() else []
    row = {"bug": bug.name, "seed": seed, "seconds": round(seconds, 1) if found else None, "file": found,
           "startup": round(started - t0, 1) if started else None,
           "stage": stage, "others": [o for o in others if not o.startswith(bug.expect)], "log": str(Path(tmp, "stderr.txt"))}
    if not found and proc.returncode not in (None, -signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM):
        row["exit"] = proc.returncode
    return row


def _stop(proc) -> None:
    """The session's process group: SIGTERM (it stops as on Ctrl-C), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_hunt(bugs: list[Bug], folder: Path, seeds=DEFAULT_SEEDS, cap: float = DEFAULT_CAP, echo=print,
             keep: str | None = None) -> list[dict]:
    rows = []
    echo(f"hunt: {len(bugs)} planted bug(s) x seeds {','.join(map(str, seeds))}, cap {cap:.0f}s each; "
         f"seconds from the session's start to the first file of its finding (start-up apart)")
    for bug in bugs:
        for seed in seeds:
            row = hunt_one(bug, folder, seed, cap, keep=keep)
            rows.append(row)
            got = f"{row['seconds']:.1f}s {row['file']} ({row['stage']})" if row["seconds"] is not None \
                else f"not seen in {cap:.0f}s" + (f" (exit {row['exit']}; {row['log']})" if "exit" in row else "")
            echo(f"  {bug.name} seed {seed}: {got}; start-up {row['startup']}s", flush=True)
    echo(table(bugs, rows, seeds, cap))
    return rows


def table(bugs: list[Bug], rows: list[dict], seeds, cap: float) -> str:
    def cell(s):
        return f">{cap:.0f}" if s is None else f"{s:.1f}"

    def cost(s):
        return cap if s is None else s

    head = ["bug", *[f"seed {s}" for s in seeds], "median", "worst", "found", "start-up"]
    lines = []
    every = []
    for bug in bugs:
        times = [r["seconds"] for r in rows if r["bug"] == bug.name]
        every += times
        med, worst = statistics.median(map(cost, times)), max(map(cost, times))
        lines.append([bug.name, *map(cell, times), cell(None if med >= cap and None in times else med),
                      cell(None if None in times else worst), f"{sum(t is not None for t in times)}/{len(times)}",
                      _median_of([r["startup"] for r in rows if r["bug"] == bug.name])])
    med, worst = statistics.median(map(cost, every)), max(map(cost, every))
    lines.append(["all", *[""] * len(seeds), cell(None if med >= cap and None in every else med),
                  cell(None if None in every else worst), f"{sum(t is not None for t in every)}/{len(every)}",
                  _median_of([r["startup"] for r in rows])])
    width = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda r: " | ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, width)))  # noqa: E731
    return "\n".join([fmt(head), "-+-".join("-" * w for w in width), *map(fmt, lines[:-1]),
                      "-+-".join("-" * w for w in width), fmt(lines[-1])])


def _median_of(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.1f}" if xs else "?"
