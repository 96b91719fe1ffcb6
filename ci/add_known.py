"""Record findings in the known-findings list (fuzzshard/known/).

    python ci/add_known.py FINDING.json "one-line diagnosis" [...pairs]
    python ci/add_known.py --trigger '{"checkpoint.kind": "broadcast"}' HANG.json "diagnosis"
    python ci/add_known.py --as-recorded --devices cuda GPU_FINDING.json "diagnosis"

--as-recorded keeps the verdict and environment the finding file holds (a
finding seen on a machine this one is not, e.g. a GPU node: replay it there
first); --devices limits it to cases on those devices, so a torch bug seen
only on CUDA never hides a new bug of the same signature on the CPU.

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
from fuzzshard.findings.record import KNOWN_DIR, Finding, environment, load_finding, load_known, write_finding
from fuzzshard.findings.judge import judge
from fuzzshard.pool.runner import Pool


def main(pairs, trigger=None, as_recorded=False, devices=()):
    items = [(load_finding(p), d) for p, d in zip(pairs[::2], pairs[1::2])]
    if as_recorded:
        for f, diagnosis in items:
            env = {**f.environment, "device": f.environment.get("device") or f.case.device}
            new = Finding(f.signature, f.case, f.verdict, environment=env, diagnosis=diagnosis,
                          trigger=trigger or {}, devices=list(devices))
            _replace(new)
        (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")
        return
    with Pool(max(f.case.ranks for f, _ in items), case_timeout=30) as pool:
        env = environment(pool.info, "gloo", "cpu")
        for f, diagnosis in items:
            j = judge(pool, f.case)
            if j.signature is None:
                print(f"SKIP (does not reproduce now: {j.label}): {f.signature}")
                continue
            sig, v = j.signature, j.verdict
            _replace(Finding(sig, f.case, v, environment=env, diagnosis=diagnosis, trigger=trigger or {},
                             devices=list(devices)))
    (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")


def _replace(finding) -> None:
    path = KNOWN_DIR / f"{finding.signature}.json"
    if path.exists() and not finding.root_cause:  # the root cause stays what it was
        finding.root_cause = load_finding(path).root_cause
    for old in KNOWN_DIR.glob(f"{finding.signature}.*"):
        old.unlink()  # replace, even with a larger case: the diagnosis is new
    write_finding(KNOWN_DIR, finding, None)
    print(f"known: {finding.signature}")


def _usage(code: int) -> None:
    """The docstring: on stdout and exit 0 when asked for (--help), else on stderr and exit 2 (bad usage)."""
    print(__doc__, file=sys.stdout if code == 0 else sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    args, trigger, as_recorded, devices = sys.argv[1:], None, False, ()
    if {"-h", "--help"} & set(args):
        _usage(0)
    while args[:1] and args[0].startswith("--"):
        if args[0] == "--trigger" and len(args) > 1:
            trigger, args = json.loads(args[1]), args[2:]
        elif args[0] == "--devices" and len(args) > 1:
            devices, args = args[1].split(","), args[2:]
        elif args[0] == "--as-recorded":
            as_recorded, args = True, args[1:]
        else:
            _usage(2)
    if len(args) < 2 or len(args) % 2:
        _usage(2)
    main(args, trigger, as_recorded, devices)
