"""ci/version_smoke.sh's clean session: `fuzzshard fuzz ARGS` in this process, then one line per built-in
target with the cases that reached a verdict on this torch (passed, or a finding new or known; invalid draws and
fuzzshard's own errors apart), so the smoke can tell that every target ran: a target that only ever draws
invalid cases on a release would otherwise pass as clean. Exit status: fuzz's.

usage: python ci/smoke_session.py FUZZ_ARGS...      (the arguments of `fuzzshard fuzz`)
prints: "smoke-target NAME: R ran (P passed, F findings, I invalid, E internal errors)" per target, on stdout
"""
import collections
import sys

from fuzzshard import targets
from fuzzshard.cli import main

seen: dict = collections.defaultdict(collections.Counter)  # target -> verdict status -> cases


def _counting() -> None:
    """Count each case's verdict per target: Session.on_case, the hook a soak logs its cases through, called once
    per case run, known hits too (imported here, not above: --help imports no torch)."""
    from fuzzshard.session.engine import Session

    on_case = Session.on_case

    def _count(self, case, verdict, sig):
        seen[case.target][verdict.status] += 1
        return on_case(self, case, verdict, sig)

    Session.on_case = _count


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # this script's usage, then fuzz's flags (argparse exits 0)
        print(__doc__)
        main(["fuzz", "--help"])
    _counting()
    code = main(["fuzz", *sys.argv[1:]])
    for name in targets.builtin():
        n = seen[name]
        print(f"smoke-target {name}: {n['pass'] + n['finding']} ran ({n['pass']} passed, {n['finding']} findings, "
              f"{n['invalid']} invalid, {n['error']} internal errors)", flush=True)
    sys.exit(code)
