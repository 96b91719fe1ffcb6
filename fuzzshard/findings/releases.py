"""Which torch releases have a finding: its replay on every release there is a venv for, one warm pool per
release, and what that says (first bad, last good, fixed in).

The driver (``fuzzshard bisect``) runs this module once per release, in that release's venv python
(``python -m fuzzshard.cli.release_run --json OUT FILE...``, fuzzshard's own code from this tree on
PYTHONPATH, so every release runs the same fuzzshard), which replays every file on one pool as `known
--check` does and writes each one's outcome. Outcomes are stored in `known --check`'s words (a known
finding's ``seen_on`` keeps them): "reproduces" (its recorded signature), "fixed" (passes: shown as
"passes", since a release before the bug came in passes too), "differs (LABEL)" (fails otherwise: another
signature, or "error"/"invalid" where fuzzshard could not run it there), "skipped" (recorded on CUDA).

A root cause's ``fixed_in`` (known/root_causes.json) is derived from its findings' ``seen_on``: a fix is the
torch bug's, as its upstream state is, and each finding's own outcomes are already in its file."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENVS = Path(os.environ.get("VENVS") or Path.home() / ".cache/fuzzshard/venvs")  # as ci/version_smoke.sh
RUN = "fuzzshard.cli.release_run"  # the per-release run, a command of its own (cli/release_run.py)
SMOKE = Path(__file__).resolve().parents[2] / "ci" / "version_smoke.sh"  # makes a release's venv (a checkout's)


def release_of(version: str) -> str:
    """The release a torch version is: "2.13.0+cpu" -> "2.13.0", "2.10.0+cu128" -> "2.10.0"."""
    return version.split("+", 1)[0]


def release_key(release: str) -> tuple:
    """Release order: "2.9.1" < "2.10.0" < "2.10.0.dev1" text-wise after its numbers."""
    nums = re.match(r"[\d.]*\d", release)
    return tuple(int(n) for n in nums.group(0).split(".")) if nums else (), release


def is_bad(status: str) -> bool:
    return status.split(" ")[0] in ("reproduces", "differs")


def shown(status: str) -> str:
    """A stored outcome as the table says it."""
    word, _, rest = status.partition(" ")
    return {"fixed": "passes", "differs": f"fails otherwise {rest}".strip()}.get(word, status)


# ---- what a finding's outcomes over releases say (pure: the tests feed them fake outcomes)

def first_bad(outcomes: dict[str, str]) -> str | None:
    """The oldest release it reproduces on."""
    return next((v for v in sorted(outcomes, key=release_key) if outcomes[v] == "reproduces"), None)


def last_good(outcomes: dict[str, str]) -> str | None:
    """The release checked just before the first bad one, where it passes there (a failure of another kind
    right before it leaves the bug's start unknown)."""
    bad = first_bad(outcomes)
    before = [v for v in sorted(outcomes, key=release_key) if release_key(v) < release_key(bad or "")
              and outcomes[v] != "skipped"] if bad else []
    return before[-1] if before and outcomes[before[-1]] == "fixed" else None


def fixed_in(states: dict[str, str]) -> str | None:
    """The first release where it passes right after one where it reproduced, and on every release checked
    after it (a pass followed by another failure is no fix). ``states``: release -> outcome ("skipped": no
    evidence)."""
    ran = [v for v in sorted(states, key=release_key) if states[v] != "skipped"]
    for i, v in enumerate(ran):
        if i and states[ran[i - 1]] == "reproduces" and all(states[w] == "fixed" for w in ran[i:]):
            return v
    return None


def root_cause_states(seen_ons: list[dict]) -> dict[str, str]:
    """A root cause's outcome per release from its findings' outcomes: "reproduces" where any reproduces;
    "fixed" where every finding that ran on any release ran there and passes (a sample of them passing is
    no evidence for the others: "unchecked" where the rest did not run); "skipped" where none ran; else
    "differs"."""
    runs = [s for s in seen_ons if any(o != "skipped" for o in s.values())]
    states = {}
    for v in {v for s in runs for v in s}:
        got = [s.get(v, "skipped") for s in runs]
        states[v] = ("reproduces" if "reproduces" in got else "fixed" if all(g == "fixed" for g in got) else
                     "skipped" if all(g == "skipped" for g in got) else
                     "unchecked" if all(g in ("fixed", "skipped") for g in got) else "differs")
    return states


def regression_table(known: dict, causes: dict) -> list[str]:
    """known/README.md's regression table: root cause x release, from what each known finding gave there
    (``seen_on``), with the first release a root cause reproduces on and its fix (``fixed_in``). A cell:
    reproduces (any of its findings does), passes (every one checked there passes), fails otherwise (none
    reproduces, some fail with another signature), - (none ran there: CUDA only, or not checked); the counts
    are reproduces / passes / fails otherwise, in findings."""
    releases = sorted({v for f in known.values() for v in f.seen_on}, key=release_key)
    if not releases:
        return []
    rows = ["", "## Regression table", "",
            "Each known finding replayed on each torch release (CPU, gloo; `fuzzshard bisect --known --record "
            "--torch V,...` regenerates it; the wall time of the last run per release is in docs/versions.md): "
            "per root cause, whether its findings reproduce there, pass, or fail otherwise (reproduces / passes "
            "/ fails otherwise, in findings), the oldest release checked where it reproduces (first bad), the "
            "release checked before that if all its findings pass there (last good: a regression), and the "
            "release that fixed it (every finding passes there and after, and one reproduced on the release before; "
            "`fixed_in` in root_causes.json). Each finding's file records its outcome per release (`seen_on`).",
            "", "| root cause | " + " | ".join(releases) + " | first bad | last good | fixed in |",
            "|---|" + "---|" * (len(releases) + 3)]
    by_cause: dict[str, list] = {}
    for sig, f in sorted(known.items()):
        by_cause.setdefault(f.root_cause or sig, []).append(f)
    for rid in sorted(by_cause):
        cells = []
        for v in releases:
            got = [f.seen_on.get(v, "skipped").split(" ")[0] for f in by_cause[rid]]
            n = {k: got.count(k) for k in ("reproduces", "fixed", "differs")}
            word = ("reproduces" if n["reproduces"] else "passes" if n["fixed"] and not n["differs"] else
                    "fails otherwise" if n["differs"] else "-")
            cells.append(word if word == "-" else f"{word} {n['reproduces']}/{n['fixed']}/{n['differs']}")
        states = root_cause_states([f.seen_on for f in by_cause[rid]])
        fix = fixed_in(states)  # what record_fixed_in writes to root_causes.json, from the same outcomes
        rows.append(f"| `{rid}` | " + " | ".join(cells) + f" | {first_bad(states) or '-'} | "
                    f"{last_good(states) or '-'} | {f'**{fix}**' if fix else '-'} |")
    return rows


# ---- the driver: a venv per release, one run in each

def cached(venvs: Path = VENVS) -> dict[str, str]:
    """release -> its venv's python, for each venv ci/version_smoke.sh made whole in ``venvs``."""
    out = {}
    for marker in sorted(venvs.glob("torch-*/.fuzzshard-smoke")):
        python = marker.parent / "bin" / "python"
        if python.exists():
            out[marker.parent.name[len("torch-"):]] = str(python)
    return out


def build(release: str, venvs: Path, log_dir: Path) -> str:
    """Make a release's venv as the version smoke does (SMOKE_VENV_ONLY=1 ci/version_smoke.sh V): its python.
    RuntimeError with the reason if it cannot."""
    if not SMOKE.exists():
        raise RuntimeError(f"no {SMOKE} to make a venv with (a source checkout of fuzzshard has it)")
    env = {**os.environ, "SMOKE_VENV_ONLY": "1", "VENVS": str(venvs), "PIP_CONSTRAINT": "/dev/null"}
    done = subprocess.run(["bash", str(SMOKE), release, str(log_dir / f"venv-{release}")], env=env,
                          capture_output=True, text=True)
    python = venvs / f"torch-{release}" / "bin" / "python"
    if done.returncode or not python.exists():
        last = (done.stdout.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"could not make a venv for torch {release}: {last} (log: {log_dir}/venv-{release})")
    return str(python)


def run_release(python: str, paths: list[str], flags: list[str], out: Path, log: Path) -> dict:
    """One release's run in its python; its result, with ``seconds`` (wall time, the pool's start included)
    and ``failed`` (a run that wrote no result: the tail of its log)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.monotonic()
    with open(log, "w") as lf:
        done = subprocess.run([python, "-m", RUN, "--json", str(out), *flags, *paths],
                              stdout=lf, stderr=subprocess.STDOUT, env=env)
    seconds = round(time.monotonic() - t0, 1)
    if done.returncode or not out.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"torch": "", "results": {}, "notes": {}, "seconds": seconds,
                "failed": f"exit {done.returncode}: {tail[0][:200]} (log: {log})"}
    return {**json.loads(out.read_text()), "seconds": seconds}


def table(paths: list[str], signatures: dict[str, str], runs: dict[str, dict]) -> list[str]:
    """The text table: one finding, a row per release; several, a row per finding and a column per release.
    Then first bad / last good / fixed in, and each release's wall time."""
    releases = sorted(runs, key=release_key)
    lines = []
    outcomes = {p: {v: runs[v]["results"][p] for v in releases if p in runs[v]["results"]} for p in paths}
    if len(paths) == 1:
        p = paths[0]
        lines += [f"{signatures[p] or p}", f"  {'release':10} outcome"]
        for v in releases:
            got = shown(outcomes[p][v]) if v in outcomes[p] else f"not run ({runs[v].get('failed')})"
            note = runs[v].get("notes", {}).get(p)
            lines.append(f"  {v:10} {got}" + (f": {note}" if note else ""))
    else:
        width = max(len(v) for v in releases) + 2
        short = {"reproduces": "bad", "fixed": "ok", "differs": "other", "skipped": "-"}
        name = max(len(signatures[p] or p) for p in paths)
        lines.append(f"{'finding':{name}} " + "".join(f"{v:{width}}" for v in releases)
                     + "first bad  last good  fixed in")
        for p in paths:
            cells = "".join(f"{short.get(outcomes[p].get(v, '?').split(' ')[0], '?'):{width}}" for v in releases)
            o = outcomes[p]
            lines.append(f"{signatures[p] or p:{name}} {cells}{first_bad(o) or '-':11}{last_good(o) or '-':11}"
                         f"{fixed_in(o) or '-'}")
        lines.append("  bad: reproduces (its signature), ok: passes, other: fails otherwise, -: skipped (CUDA)")
        others = [(p, v, o[v]) for p, o in outcomes.items() for v, s in sorted(o.items()) if s.startswith("differs")]
        lines += [f"  {signatures[p] or p} on {v}: {shown(s)}" for p, v, s in others]
    if len(paths) == 1:
        o = outcomes[paths[0]]
        bad, good = first_bad(o), last_good(o)
        ran = [v for v in sorted(o, key=release_key) if o[v] != "skipped"]
        if good or not bad:
            why = good or "-"
        elif ran[0] == bad:
            why = "none checked (it reproduces on the oldest release checked)"
        else:
            why = "unknown (it fails otherwise on the release before)"
        lines += [f"first bad: {bad or 'none (it reproduces on no release checked)'}", f"last good: {why}"]
        if fixed_in(o):
            lines.append(f"fixed in:  {fixed_in(o)}")
    lines.append("wall time: " + ", ".join(f"{v} {runs[v]['seconds']:.0f}s" for v in releases))
    return lines


def bisect(paths: list[str], pythons: dict[str, str], flags: list[str], work: Path) -> dict[str, dict]:
    """Each release's run, the oldest first: release -> its result."""
    runs = {}
    for v in sorted(pythons, key=release_key):
        print(f"torch {v}: replaying {len(paths)} finding(s) ({pythons[v]})", flush=True)
        runs[v] = run_release(pythons[v], paths, flags, work / f"result-{v}.json", work / f"replay-{v}.log")
        print(f"torch {v}: {runs[v].get('failed') or 'done'} in {runs[v]['seconds']:.0f}s", flush=True)
    return runs


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="fuzzshard-bisect-"))

