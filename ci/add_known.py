"""Record findings in the known-findings list (fuzzshard/known/).

    python ci/add_known.py FINDING.json "one-line diagnosis" [...pairs]
    python ci/add_known.py --trigger '{"checkpoint.kind": "broadcast"}' HANG.json "diagnosis"

A trigger (known hangs only) lists the case fields that always hit the hang
(a list value: any of these); sessions count a matching case as a hit
without running it, since every such run would cost the case timeout.

Re-runs each case once (localized) so the stored verdict and signature come
from the current kernel, then rewrites known/README.md. Only the JSON is kept:
`fuzzshard script X.json` writes the standalone script from the current kernel.
"""
import json
import sys

from fuzzshard.cli import known_markdown
from fuzzshard.engine import localized
from fuzzshard.findings import KNOWN_DIR, Finding, environment, load_finding, load_known, signature, write_finding
from fuzzshard.runner import Pool


def main(pairs, trigger=None):
    items = [(load_finding(p), d) for p, d in zip(pairs[::2], pairs[1::2])]
    with Pool(max(f.case.ranks for f, _ in items), case_timeout=30) as pool:
        env = environment(pool.info, "gloo")
        for f, diagnosis in items:
            v = localized(pool, f.case, pool.run(f.case).verdict)
            if v["status"] != "finding":
                print(f"SKIP (does not reproduce now: {v['status']}): {f.signature}")
                continue
            sig = signature(f.case, v)
            new = Finding(sig, f.case, v, environment=env, diagnosis=diagnosis, trigger=trigger or {})
            for old in KNOWN_DIR.glob(f"{sig}.*"):
                old.unlink()  # replace, even with a larger case: the diagnosis is new
            write_finding(KNOWN_DIR, new, None)
            print(f"known: {sig}")
    (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")


if __name__ == "__main__":
    args, trigger = sys.argv[1:], None
    if args[:1] == ["--trigger"]:
        trigger, args = json.loads(args[1]), args[2:]
    if len(args) < 2 or len(args) % 2:
        sys.exit(__doc__)
    main(args, trigger)
