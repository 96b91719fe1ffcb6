"""Run every finding's standalone script of a folder under torchrun, as a maintainer would: one row each
(signature, straight-line or flattened, lines, exit code), then the count that show their bug (exit 1).

    python ci/run_scripts.py OUT [--setup PATCH.py]    # OUT: a fuzz session's --out, or fuzzshard/known

ci/gpu_check.sh runs it on a GPU node after the replay table; a script runs on the device and backend its
case was recorded on, so on a CPU machine a CUDA finding's row says so instead of running.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT = 300


def main(out: str, extra: list[str]) -> int:
    import torch

    rows, shown = [], 0
    files = sorted(p for p in Path(out).glob("*.json") if p.name != "root_causes.json")
    with tempfile.TemporaryDirectory(prefix="fuzzshard-scripts-") as tmp:
        for f in files:
            data = json.loads(f.read_text())
            case = data.get("case", data)
            script = Path(tmp) / f"{f.stem.replace('.', '_')}.py"
            w = subprocess.run([sys.executable, "-m", "fuzzshard", "script", str(f), "-o", str(script)],
                               capture_output=True, text=True)
            if w.returncode != 0:
                rows.append((data.get("signature", f.stem), "-", 0, f"script: exit {w.returncode}"))
                continue
            text = script.read_text()
            kind = "flattened" if "flattened" in text[:2000].lower() else "straight"
            if case.get("device") == "cuda" and not torch.cuda.is_available():
                rows.append((data.get("signature", f.stem), kind, text.count("\n"), "not run: needs CUDA"))
                continue
            ranks = case.get("world_size", 1)
            try:
                r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                    str(ranks), str(script), *extra], capture_output=True, text=True,
                                   timeout=TIMEOUT, cwd=tmp)
                code = r.returncode
            except subprocess.TimeoutExpired:
                code = 124
            shown += code == 1
            rows.append((data.get("signature", f.stem), kind, text.count("\n"), f"exit {code}"))
    head = ("signature", "script", "lines", "torchrun")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print(f"{shown} of {len(rows)} scripts show their bug (exit 1) under torchrun")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the usage, on stdout; nothing run
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
