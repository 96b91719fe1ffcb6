"""Judging a simulated session's case on real gloo process groups (life.confirm_on_real's helpers).

A simulated finding is one only once its case fails the same way on real processes, as many as its ranks,
where this machine runs that many (``REAL_MAX``). Here: one case judged on a real pool the caller hands in
(``judge_for_real``), what real processes gave written as a finding (``write_real``), and LocalTensor's own
errors that the session set aside unshrunk (localtensor.py) judged so (``confirm_set_aside``): one larger
than REAL_MAX is first tried, simulated, on the largest 1-D world that fits and fails the same
(``real_sized``, through the one shrinker's world edits). docs/simulate.md says more."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .files import keep_apart, put_finding
from .judge import judge
from .record import Finding, Stage, environment, load_known, summary
from .shrink_world import MESH_PARTS, world_edits

# the largest world size confirmed on real process groups here (ranks are processes: 8 on this machine)
REAL_MAX_ENV = "FUZZSHARD_REAL_MAX"
REAL_MAX = int(os.environ.get(REAL_MAX_ENV, "8"))
LIMITS = "simulation_limits"  # OUT/<this>/: simulated findings that do not reproduce on real process groups


def judge_for_real(case, pools, known) -> tuple:
    """``case`` judged on fresh real gloo processes, as many as its ranks (``pools.real``: the caller's):
    (the judgement, the environment, what the finding's file records of the real run)."""
    with pools.real(case.ranks) as pool:
        j = judge(pool, case, known)
        env = environment(pool.info, pool.options.backend, pool.options.device)
    real = {"signature": j.signature, "status": j.verdict.status, "world_size": case.ranks, "known": j.known,
            "seconds": round(j.seconds, 3)}
    if j.verdict.is_finding:
        real["summary"] = summary(j.verdict)
    return j, env, real


def write_real(out: Path, case, j, env: dict, status: str, real: dict):
    """OUT/<the real run's signature>.json + .py: what real processes gave for a simulated case."""
    f = Finding(j.signature, case, j.verdict, environment=env, stage=Stage.CONFIRMED)
    put_finding(out, f, simulation={"status": status, "real": real})
    return f


def confirm_set_aside(set_aside: dict, out: Path, pools, result: dict, progress) -> None:
    """LocalTensor's own errors (SimulatedBook.set_aside: signature -> (case, verdict, why, hits)) judged on
    real processes: the same signature makes it a finding, another finding not known is one of its own, else
    it is kept apart as a limitation; ``result`` (life.confirm_on_real's) says which."""
    known = load_known()
    limits = out / LIMITS
    for sig, (case, verdict, why, hits) in sorted(set_aside.items()):
        w = case.ranks
        result["set_aside"].append(sig)
        data = {"signature": sig, "summary": summary(verdict), "case": json.loads(case.to_json()),
                "verdict": verdict.to_dict(), "stage": "set aside unshrunk", "hits": hits}
        if w > REAL_MAX:  # only the world size is shrunk: to the largest 1-D world <= REAL_MAX that fails the same
            smaller = real_sized(case, sig, pools)
            if smaller is None:
                only = Stage.SIMULATED_ONLY.value
                data["simulation"] = {"status": f"LocalTensor's own error ({why}); {only}: {w} ranks, and "
                                                f"no 1-D world of <= {REAL_MAX} ranks fails the same way simulated"}
                keep_apart(out, LIMITS, sig, data)
                result["limits"].append(sig)
                print(f"fuzzshard: {sig}: LocalTensor's own error, {only} ({w} ranks; none of <= {REAL_MAX} "
                      f"fails the same way) -> {limits}/{sig}.json", file=progress)
                continue
            data.update(removed=[f"world size {w} -> {smaller.ranks}"], case=json.loads(smaller.to_json()))
            case, w = smaller, smaller.ranks
        print(f"fuzzshard: {sig}: LocalTensor's own error, {hits} case(s); its smallest on {w} real gloo processes",
              file=progress, flush=True)
        j, env, real = judge_for_real(case, pools, known)
        if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
            # a finding already written (this session's, shrunk and confirmed: e.g. replicas that diverged, which a
            # later .item() or float(loss) of them turns into LocalTensor's own error): one more case of it, kept as is
            result.setdefault("met", {})[sig] = j.signature
            print(f"fuzzshard: {sig}: real processes give {j.signature}, a finding already in {out} (its file kept)",
                  file=progress)
            continue
        if j.verdict.is_finding and not j.known:  # a real finding: the same signature, or a real bug of its own
            f = write_real(out, case, j, env, "confirmed on real process groups" if j.signature == sig else
                            f"found on real process groups through a simulated case that ended in LocalTensor's "
                            f"own error ({sig}: {why}); not shrunk", real)
            if j.signature == sig:
                result["confirmed"].append(sig)
            result["found"].append(f)
            print(f"fuzzshard: {sig}: real processes give {'the same' if j.signature == sig else 'a NEW finding'} "
                  f"({j.signature}) -> {out}/{j.signature}.json", file=progress)
            continue
        data["simulation"] = {"status": f"LocalTensor limitation, recognised up front ({why}): not shrunk; "
                                        f"not reproduced on real process groups", "real": real}
        keep_apart(out, LIMITS, sig, data)
        result["limits"].append(sig)
        print(f"fuzzshard: {sig}: not a finding: real processes give {j.label}{' (known)' if j.known else ''} "
              f"-> {limits}/{sig}.json (a LocalTensor limitation)", file=progress)


def real_sized(case, sig: str, pools):
    """``case`` on the largest 1-D world of at most REAL_MAX ranks (the one shrinker's world edits,
    shrink_world.py) that still gives ``sig`` simulated (``pools.simulated``: the caller's), or None: what a
    set-aside case larger than this machine's real runs is checked as."""
    from ..case import Case

    tries = []
    for what, data in world_edits(json.loads(case.to_json())):
        if data is not None and what.startswith("world size") and MESH_PARTS not in what \
                and data["world_size"] <= REAL_MAX:
            try:
                tries.append(Case.from_dict(data))
            except Exception:  # an edit the case's options cannot take: not tried
                continue
    tries.sort(key=lambda c: -c.ranks)
    with pools.simulated() as pool:
        return next((c for c in tries if judge(pool, c).signature == sig), None)
