"""Record findings in the known-findings list (fuzzshard/known/).

    python ci/add_known.py FINDING.json "one-line diagnosis" [...pairs]

Re-runs each case once (localized) so the stored verdict and signature come
from the current kernel, then rewrites known/README.md. Only the JSON is kept:
`fuzzshard script X.json` writes the standalone script from the current kernel.
"""
import sys

from fuzzshard.cli import known_markdown
from fuzzshard.engine import localized
from fuzzshard.findings import KNOWN_DIR, Finding, environment, load_finding, load_known, signature, write_finding
from fuzzshard.runner import Pool


def main(pairs):
    items = [(load_finding(p), d) for p, d in zip(pairs[::2], pairs[1::2])]
    with Pool(max(f.case.world_size for f, _ in items)) as pool:
        env = environment(pool.info, "gloo")
        for f, diagnosis in items:
            v = localized(pool, f.case, pool.run(f.case).verdict)
            if v["status"] != "finding":
                print(f"SKIP (does not reproduce now: {v['status']}): {f.signature}")
                continue
            sig = signature(f.case, v)
            new = Finding(sig, f.case, v, environment=env, diagnosis=diagnosis)
            for old in KNOWN_DIR.glob(f"{sig}.*"):
                old.unlink()  # replace, even with a larger case: the diagnosis is new
            write_finding(KNOWN_DIR, new, None)
            print(f"known: {sig}")
    (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or len(sys.argv) % 2 != 1:
        sys.exit(__doc__)
    main(sys.argv[1:])
