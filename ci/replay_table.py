"""Replay every finding of a fuzz session's --out folder in a fresh process
(``fuzzshard replay``, on the device each was recorded on) and print one
table: signature, session verdict, fresh verdict, same or not. Exit 0 only
when every finding replays as itself.

    python ci/replay_table.py OUT [--worker-setup FILE.py]
"""
import json
import subprocess
import sys
from pathlib import Path


def main(out: str, extra: list[str]) -> int:
    files = sorted(Path(out).glob("*.json"))
    rows, bad = [], 0
    for f in files:
        recorded = json.loads(f.read_text())
        r = subprocess.run([sys.executable, "-m", "fuzzshard", "replay", str(f), *extra], capture_output=True, text=True)
        first = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["?"])[0]
        fresh = {0: "passes", 1: "same finding", 3: first.replace("FAILS DIFFERENTLY: ", "fails as ")}.get(
            r.returncode, f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['?'])[-1][:80]}")
        same = r.returncode == 1
        bad += not same
        rows.append((recorded["signature"], f"finding ({recorded.get('stage', 'confirmed')})", fresh, "yes" if same else "NO"))
    head = ("signature", "session verdict", "fresh verdict", "same")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print(f"{len(rows) - bad} of {len(rows)} findings replay as themselves in a fresh process")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the usage, on stdout; nothing run
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
