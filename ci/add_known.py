"""Record findings in the known-findings list (fuzzshard/known/).

    python ci/add_known.py FINDING.json "one-line diagnosis" [...pairs]
    python ci/add_known.py --trigger '{"checkpoint.kind": "broadcast"}' HANG.json "diagnosis"
    python ci/add_known.py --as-recorded --devices cuda GPU_FINDING.json "diagnosis"
    python ci/add_known.py --suffix dropout --only-when '{"facts.dropout": true}' F.json "diagnosis"

--as-recorded keeps the verdict and environment the finding file holds (a
finding seen on a machine this one is not, e.g. a GPU node: replay it there
first); --devices limits it to cases on those devices, so a torch bug seen
only on CUDA never hides a new bug of the same signature on the CPU.

--only-when makes it known only for cases that match (field paths and
facts.NAME, as a trigger; a list value: any of these); recorded again
without it, a known finding keeps the one it had. --suffix WORD records it
as known/<signature>.WORD.json: another root cause under a signature a known
finding has already; each of them needs an --only-when that tells it apart
(a session tries <signature>.json first, then the suffixed ones in order,
and the first whose only_when holds for the case is the hit).

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
from fuzzshard.pool.options import PoolOptions
from fuzzshard.pool.runner import Pool


def main(pairs, trigger=None, as_recorded=False, devices=(), only_when=None, suffix=""):
    items = [(load_finding(p), d) for p, d in zip(pairs[::2], pairs[1::2])]
    if as_recorded:
        for f, diagnosis in items:
            env = {**f.environment, "device": f.environment.get("device") or f.case.device}
            new = Finding(f.signature, f.case, f.verdict, environment=env, diagnosis=diagnosis,
                          trigger=trigger or {}, only_when=only_when or {}, devices=list(devices))
            _replace(new, suffix)
        (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")
        return
    with Pool(max(f.case.ranks for f, _ in items), options=PoolOptions(case_timeout=30)) as pool:
        env = environment(pool.info, "gloo", "cpu")
        for f, diagnosis in items:
            j = judge(pool, f.case)
            if j.signature is None:
                print(f"SKIP (does not reproduce now: {j.label}): {f.signature}")
                continue
            sig, v = j.signature, j.verdict
            _replace(Finding(sig, f.case, v, environment=env, diagnosis=diagnosis, trigger=trigger or {},
                             only_when=only_when or {}, devices=list(devices)), suffix)
    (KNOWN_DIR / "README.md").write_text(known_markdown(load_known()) + "\n")


def _replace(finding, suffix: str = "") -> None:
    name = f"{finding.signature}.{suffix}" if suffix else finding.signature
    path = KNOWN_DIR / f"{name}.json"
    if path.exists():  # the root cause and the conditions stay what they were
        old = load_finding(path)
        finding.root_cause = finding.root_cause or old.root_cause
        finding.only_when = finding.only_when or old.only_when
    for old in (path, path.with_suffix(".py")):  # (not a suffixed sibling: another root cause)
        old.unlink(missing_ok=True)  # replace, even with a larger case: the diagnosis is new
    write_finding(KNOWN_DIR, finding, None, name=name)
    print(f"known: {name}")


def _usage(code: int) -> None:
    """The docstring: on stdout and exit 0 when asked for (--help), else on stderr and exit 2 (bad usage)."""
    print(__doc__, file=sys.stdout if code == 0 else sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    args, trigger, as_recorded, devices, only_when, suffix = sys.argv[1:], None, False, (), None, ""
    if {"-h", "--help"} & set(args):
        _usage(0)
    while args[:1] and args[0].startswith("--"):
        if args[0] == "--trigger" and len(args) > 1:
            trigger, args = json.loads(args[1]), args[2:]
        elif args[0] == "--devices" and len(args) > 1:
            devices, args = args[1].split(","), args[2:]
        elif args[0] == "--only-when" and len(args) > 1:
            only_when, args = json.loads(args[1]), args[2:]
        elif args[0] == "--suffix" and len(args) > 1:
            suffix, args = args[1], args[2:]
        elif args[0] == "--as-recorded":
            as_recorded, args = True, args[1:]
        else:
            _usage(2)
    if len(args) < 2 or len(args) % 2:
        _usage(2)
    main(args, trigger, as_recorded, devices, only_when, suffix)
