"""The straight-line repro scripts (fuzzshard/scriptgen/) over the known list:
how many findings get one, their line counts (median, max), and how many of
them, run standalone under torchrun on this torch, fail as their finding did.

    nice -n 10 python ci/script_table.py [--no-run] [--only SUBSTR,..] [--files GLOB,..] [--timeout SEC] [--jobs N] [-v]

A script reproduces its finding when it exits non-zero and says what the
finding said: for an error, the exception's type and the start of its
message; for a checkpoint or parity finding, "FINDING" and the param the
first mismatch names (or "strict" for a strict load); a crash exits
non-zero; a hang times out or fails its collective's timeout. CPU findings
only run (a CUDA one counts as not run: /work/notes/gpu_scripts.sh runs them
on a GPU node). ``--files``: finding files besides the known list (a GPU
session's, say), named by their path. A finding without a straight script
shows why it falls back to the flattened kernel, and whether its root cause
has a hand-reduced script (known/minimal/, named by root_causes.json: what an
upstream report attaches in its place). One table row per finding, then the
totals (the fallbacks, and those without a hand-reduced script, by name);
exit 0 always (a measurement, not a gate).
"""
from __future__ import annotations

import argparse
import glob
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzzshard.findings.record import load_finding, load_known, summary  # noqa: E402
from fuzzshard.findings.rootcause import load_root_causes  # noqa: E402
from fuzzshard.scriptgen import fallback_reason, straight_script  # noqa: E402


CHECKS = ("ReplicasDiverged", "GroupsLost", "PartitionBroken", "GatherMismatch", "StateNotPlain", "ShardedParamsListed")


def reproduces(finding, rc: int | None, out: str) -> bool:
    v = finding.verdict
    oracle = v.oracle if v else ""
    err = v.error_record if v and v.error else None
    quantity, fqn = (v.first.quantity, v.first.fqn or "") if v and v.first else ("", "")
    if oracle == "hang":
        return rc is None or (rc != 0 and ("imeout" in out or "timed out" in out))
    if rc is None or rc == 0:
        return False
    if oracle == "crash":
        return True
    if err:  # (fuzzshard's own checks of torch's results, ReplicasDiverged and the like, are asserts in a script)
        kind = err.type if err.type not in CHECKS else "AssertionError"
        return kind in out and (err.message[:30] in out or kind == "AssertionError")
    if "strict" in quantity:
        return "FINDING" in out and "strict" in out
    if quantity.startswith("param_groups"):  # a parity finding in the groups names no param: "step k param_groups"
        return "FINDING" in out and "param_groups" in out
    return "FINDING" in out and fqn in out


def run_script(finding, text: str, timeout: int, env: dict) -> tuple:
    """(exit code or None on a timeout, stdout + stderr) of the script under torchrun on the case's ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "repro.py"
        path.write_text(text)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(finding.case.ranks),
               str(path)]
        try:
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env)
            return r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            return None, str(e.stdout or "") + str(e.stderr or "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="count and measure only")
    ap.add_argument("--only", default="", help="signatures containing any of these (comma-separated)")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=1, help="scripts run side by side")
    ap.add_argument("--files", default="", help="finding files besides the known list (comma-separated globs)")
    ap.add_argument("-v", action="store_true", help="print the output tail of each script that does not reproduce")
    args = ap.parse_args()
    found = dict(load_known())
    for path in sorted(p for g in args.files.split(",") if g for p in glob.glob(g)):
        found[os.path.relpath(path)] = load_finding(path)
    known = {s: f for s, f in found.items() if any(o in s for o in args.only.split(","))}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUZZSHARD")}
    texts = {sig: straight_script(f.case, summary(f.verdict) if f.verdict else "", f.environment, f.verdict)
             for sig, f in known.items()}
    lines = [t.count("\n") for t in texts.values() if t is not None]
    todo = [s for s, t in texts.items() if t is not None and not args.no_run and known[s].case.device == "cpu"]
    # round robin over target x oracle, so a run cut short has seen every kind
    kinds = {}
    for s in todo:
        kinds.setdefault(tuple(s.split(".")[:2]), []).append(s)
    todo = [s for batch in itertools.zip_longest(*kinds.values()) for s in batch if s]
    results = {}

    def one(sig):
        rc, out = run_script(known[sig], texts[sig], args.timeout, env)
        ok = reproduces(known[sig], rc, out)
        print(f"{sig}: {'reproduces' if ok else f'does not (exit {rc})'}", file=sys.stderr, flush=True)
        if args.v and not ok:
            tail = [ln for ln in out.splitlines() if not ln.startswith(("W1", "[W", "*****"))][-25:]
            print(f"--- {sig}\n" + "\n".join(tail), file=sys.stderr, flush=True)
        results[sig] = ok

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    causes = load_root_causes(found)
    root = Path(__file__).resolve().parents[1]
    minimal = {sig: causes[f.root_cause].minimal for sig, f in known.items()  # a root cause's hand-reduced script
               if f.root_cause in causes and causes[f.root_cause].minimal and (root / causes[f.root_cause].minimal).exists()}
    rows = []
    for sig in sorted(known):
        t = texts[sig]
        run = "flattened" if t is None else "not run" if sig not in results else \
            "reproduces" if results[sig] else "does not"
        if t is None:
            f = known[sig]
            run = f"flattened ({fallback_reason(f.case, f.environment, f.verdict)}); " + \
                (f"hand-reduced: {Path(minimal[sig]).name}" if minimal.get(sig) else "no hand-reduced script")
        elif known[sig].case.device != "cpu":
            run = f"not run ({known[sig].case.device})"
        rows.append((sig, "-" if t is None else t.count("\n"), run))
    widths = [max(len(str(x)) for x in col) for col in zip(("signature", "lines", "run"), *rows)]
    for row in [("signature", "lines", "run"), tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print(f"straight-line scripts: {len(lines)} of {len(known)} findings ({100 * len(lines) / max(len(known), 1):.1f}%)")
    if lines:
        print(f"lines: median {statistics.median(lines):g}, max {max(lines)}, under 100: {sum(n < 100 for n in lines)}, "
              f"over 150: {sum(n > 150 for n in lines)}")
    flat = [sig for sig, t in texts.items() if t is None]
    bare = sorted(sig for sig in flat if not minimal.get(sig))
    print(f"fallbacks (the flattened kernel): {len(flat)}; of them without a hand-reduced script: {len(bare)}"
          + (f" ({', '.join(bare)})" if bare else ""))
    if not args.no_run:
        print(f"run: {len(results)}, reproduce their finding: {sum(results.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
