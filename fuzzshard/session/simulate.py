"""``--simulate``: a case's ranks in one process, under torch's LocalTensorMode.

torch.distributed._local_tensor (torch >= 2.10) runs SPMD code once for all
ranks: every tensor made inside ``LocalTensorMode(W)`` is a LocalTensor that
holds one plain tensor per rank, each op runs on every rank's tensor, and a
collective on the fake process group ("fake" backend) is done on those
tensors as gloo would do it between processes. So a case of 8, 16 or 64
ranks runs in one worker process, and each worker of the pool runs one
simulated case beside the others (runner.Pool(simulate=True)).

The kernel (kernel/run.py) runs unchanged: ``SimulatedWorld`` stands where
kernel/mesh.py's Meshes stands. While a case runs, ``placed()`` makes the
fake world of the case's size and ``job(w)`` enters LocalTensorMode over
ranks 0..w-1 around exactly what the ranks run (the sharded training, the
save, the load); the reference and the oracles run outside it on plain
tensors. Three things the harness does differently, and why:

  * the model and the batches are made outside the mode and then given to
    every rank as the same tensor. A real rank seeds its own generator and
    draws them itself, all ranks alike; under the mode one explicit
    torch.Generator is shared by all simulated ranks, which then draw one
    after the other and get different batches (a harness artefact, not a bug);
  * the observations (full params, grads, state: what the reporting rank
    gathers) are rank 0's tensors, as the real reporter sees its own;
  * gather.py's batched all-gather (it indexes a Python list with this rank's
    coordinate, which is every rank's at once here) is off: each tensor is
    gathered with its own ``full_tensor()``, which gives the same bytes.

The replica oracle runs as on real ranks, nothing switched off: a replicated
value's copy is a LocalTensor holding each simulated rank's own, so each rank
digests its own copies, the digests ride LocalTensor's all-gather, and where
they differ each rank's names and copies are handed over as a real rank's
``all_gather_object`` would (gather._all_gather_objects): the same records and
signatures (``dtensor.replica.param``) as on real process groups.

A simulated finding is a finding only once its shrunk case fails the same
way on real gloo process groups (``confirm``); one that passes there is a
LocalTensor limitation, written under OUT/simulation_limits/ and never
reported as a finding; one too large for this machine is "simulated only".
docs/simulate.md says which targets run simulated and why the others do not.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

# the targets a simulated session draws: measured, see docs/simulate.md
SIMULATED_TARGETS = ("dtensor", "tp")
# the targets whose cases may draw 3-dim meshes (their options say a placement per mesh dim)
THREE_DIM_TARGETS = ("dtensor",)
# the largest world size confirmed on real process groups here (ranks are processes: 8 on this machine)
REAL_MAX_ENV = "FUZZSHARD_REAL_MAX"
REAL_MAX = int(os.environ.get(REAL_MAX_ENV, "8"))
DEFAULT_WORLD_SIZES = "5,6,7,8,12,16,32,64"
SIMULATED_CASE_TIMEOUT = 600.0  # --case-timeout's default under --simulate (a 64-rank case: seconds, a minute loaded)
SIMULATED_ONLY = "simulated only"  # the stage of a finding too large to confirm here (cli/fuzz.py prints it)
LIMITS = "simulation_limits"  # OUT/<this>/: simulated findings that do not reproduce on real process groups


def available() -> str | None:
    """None if this torch can simulate, else why not (one line)."""
    try:
        import torch.distributed._local_tensor  # noqa: F401
        from torch._C._distributed_c10d import FakeProcessGroup  # noqa: F401
    except ImportError as e:
        return f"this torch has no LocalTensorMode ({e}); --simulate needs torch >= 2.10"
    return None


def cannot_simulate(case) -> str | None:
    """None if ``case`` runs simulated (as fuzz --simulate would run it), else why not (one line)."""
    why = available()
    if why:
        return why
    if case.target not in SIMULATED_TARGETS:
        return f"--simulate runs {', '.join(SIMULATED_TARGETS)}, not {case.target} (docs/simulate.md says why)"
    if case.checkpoint:
        return "its checkpoint is not simulated (saving and loading LocalTensors fails under LocalTensorMode)"
    return None


def simulate_args(args) -> None:
    """``fuzz --simulate``: its checks and defaults, into ``args`` (a UsageError says what is wrong)."""
    from ..cli.common import UsageError, resolve_targets

    why = available()
    if why:
        raise UsageError(f"--simulate: {why}")
    if (args.device or "cpu") != "cpu":
        raise UsageError("--simulate runs on CPU (LocalTensorMode over a fake process group)")
    names = resolve_targets(args.target)
    if args.target == "all":
        names = [n for n in names if n in SIMULATED_TARGETS]
        args.target = ",".join(names)
    other = [n for n in names if n not in SIMULATED_TARGETS]
    if other:
        raise UsageError(f"--simulate runs {', '.join(SIMULATED_TARGETS)}; not {', '.join(other)} "
                         "(docs/simulate.md says why)")
    if args.checkpoints == "all":
        raise UsageError("--simulate draws no checkpoints: torch.save, broadcast_from_rank0 and DCP of LocalTensors "
                         "fail under LocalTensorMode (docs/simulate.md)")
    if args.checkpoints == "some":  # the default: said, not silent
        print("fuzzshard: --simulate: no checkpoints (saving and loading LocalTensors is not simulated: "
              "docs/simulate.md)", file=sys.stderr)
        args.checkpoints = "none"
    if args.world_sizes == "1,2,3,4":  # draw_args' default: a simulated session is for the sizes a pool cannot reach
        args.world_sizes = DEFAULT_WORLD_SIZES
    if args.case_timeout == 120.0:  # pool_args' default: a simulated case runs its W ranks one after the other
        args.case_timeout = SIMULATED_CASE_TIMEOUT
    args.simulate_workers = max(1, os.cpu_count() or 1)  # one simulated case per core, side by side
    # dims that grow with the world size: at 64 ranks, dims of 1-9 would leave most shards empty
    args.simulate_draws = {"dims_up_to_world": True, **({"mesh_dims": 3} if all(n in THREE_DIM_TARGETS for n in names)
                                                        else {})}


# -- the worker side ----------------------------------------------------------------------------------
class SimulatedWorld:
    """What kernel/mesh.py's Meshes is to a real pool worker, for one process
    that runs whole cases alone: a fake default process group of the case's
    size, its meshes, and LocalTensorMode around what the ranks run."""

    def __init__(self):
        self.size = 0
        self._groups: dict[int, object] = {}
        self._world(1)  # a default group from the start: the worker's exit destroys it

    def _world(self, n: int) -> None:
        import torch.distributed as dist

        if self.size == n:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
            _forget_meshes()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
        self.size, self._groups = n, {}

    # -- the Meshes interface kernel/run.py uses --------------------------------------------------
    @contextlib.contextmanager
    def placed(self, offset: int, n: int):
        """The case's world: ``n`` fake ranks, whatever pool rank runs it."""
        self._world(n)
        with _patched():
            yield

    def group(self, w: int):
        import torch.distributed as dist

        if w == self.size:
            return dist.group.WORLD
        if w not in self._groups:
            self._groups[w] = dist.new_group(list(range(w)))
        return self._groups[w]

    def mesh(self, w: int, shape: tuple[int, ...]):
        import torch
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
        from torch.distributed.device_mesh import DeviceMesh

        names = tuple(f"d{i}" for i in range(len(shape))) if len(shape) > 1 else None
        with maybe_disable_local_tensor_mode():
            return DeviceMesh("cpu", torch.arange(w).view(*shape), mesh_dim_names=names)

    @contextlib.contextmanager
    def job(self, w: int):
        """Ranks 0..w-1, all of them in this process (and as the default group's first w)."""
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed._local_tensor import LocalTensorMode

        saved = c10d._world.default_pg
        c10d._world.default_pg = self.group(w)
        try:
            with LocalTensorMode(w):
                yield
        finally:
            c10d._world.default_pg = saved


def _forget_meshes() -> None:
    """DTensor's sharding cache, emptied when the fake world is made anew. DeviceMesh equality ignores the
    process groups (rank map, layout, device type, dim names), so a cached decision made on an earlier
    world's mesh hands the next world's same-shaped mesh's outputs that old mesh: its group names are
    those of destroyed groups (``Could not resolve the process group registered under the name 565``) or,
    where a name was given anew, of another group of the new world (``narrow(): length must be
    non-negative``). Seen as contaminated verdicts (warm workers only) in a session over world sizes 5-64;
    a real pool's world is made once, so it never meets this."""
    import torch
    from torch.distributed.tensor import DTensor

    cache = getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    if hasattr(cache, "cache_clear"):
        cache.cache_clear()  # the Python one
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's (>= 2.10)
    if clear is not None:
        clear()


def rank0(x):
    """``x`` with every LocalTensor in it replaced by rank 0's tensor: what the
    reporting rank of a real run holds."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(x, LocalTensor):
        return x._local_tensors[min(x._ranks)]
    if isinstance(x, dict):
        return {k: rank0(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rank0(v) for v in x]
    if isinstance(x, tuple):
        return tuple(rank0(v) for v in x)
    return x


def _lift(t, mode):
    """A plain tensor as every rank's own copy of it."""
    from torch.distributed._local_tensor import LocalTensor

    return t if isinstance(t, LocalTensor) else mode.rank_map(lambda r: t.detach().clone())


@contextlib.contextmanager
def _patched():
    """The three differences the module docstring names, for the length of one
    simulated case (a simulated worker runs nothing else)."""
    import torch
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    from ..kernel import gather, run
    from .simulate_fast import installed

    build_model, make_batch, run_sharded, batchable = (run.build_model, run.make_batch, run._run_sharded,
                                                       gather._gather_batchable)

    def built(*args, **kwargs):
        mode = enabled_local_tensor_mode()
        if mode is None:
            return build_model(*args, **kwargs)
        with mode.disable():
            net = build_model(*args, **kwargs)
        shared: dict[int, torch.nn.Parameter] = {}  # a tied param stays one param
        for m in net.modules():
            for name, p in list(m.named_parameters(recurse=False)):
                if id(p) not in shared:
                    shared[id(p)] = torch.nn.Parameter(_lift(p.data, mode), requires_grad=p.requires_grad)
                setattr(m, name, shared[id(p)])
            for name, b in list(m.named_buffers(recurse=False)):
                m._buffers[name] = _lift(b, mode)
        return net

    def batch(*args, **kwargs):
        mode = enabled_local_tensor_mode()
        if mode is None:
            return make_batch(*args, **kwargs)
        with mode.disable():
            x, y = make_batch(*args, **kwargs)
        return _lift(x, mode), _lift(y, mode)

    def sharded(*args, **kwargs):
        obs, error = run_sharded(*args, **kwargs)
        return rank0(obs), error

    run.build_model, run.make_batch, run._run_sharded = built, batch, sharded
    gather._gather_batchable = lambda t: enabled_local_tensor_mode() is None and batchable(t)
    try:
        with installed():  # LocalTensorMode's costs a case does not need (simulate_fast.py)
            yield
    finally:
        run.build_model, run.make_batch, run._run_sharded = build_model, make_batch, run_sharded
        gather._gather_batchable = batchable


# -- the driver side: LocalTensor's own errors, set aside unshrunk -------------------------------------
# Errors LocalTensor itself raises where a real rank could not: a simulated
# case that ends in one is no finding of the kind a real run gives, so the
# session neither confirms it in fresh simulated workers nor shrinks it (a
# minute or more of simulated cases, for a file the real check then sets
# apart): its smallest case goes straight to the real-process check at the
# session's end (confirm(set_aside=...)), which stays the judge; one of more
# ranks than run for real here is first tried on 1-D worlds of at most
# REAL_MAX ranks, simulated, and checked at the largest that fails the same.
# Each: what the message holds, what the traceback holds, why (docs/simulate.md):
LOCAL_TENSOR_ERRORS = (  # (the message holds, the traceback holds or "", why)
    # _local_tensor's _combine_any_rank_results: an op's result other than a tensor or an int differs between
    # the simulated ranks. Seen: Adafactor's p.norm(2).item() where the norm is Partial (a float per rank), and
    # torch.chunk of a LocalTensor whose ranks hold shards of different lengths (lists of different lengths)
    ("Non Tensor or int rank results must be equal for all ranks", "",
     "an op's non-tensor, non-int results differ between the simulated ranks (a float from .item(), a list of "
     "another length per rank): LocalTensor carries per-rank tensors and ints only"),
    # the same lists of different lengths where rank 0's is the longer: the shorter ranks' missing entries are
    # None, and LocalTensor({rank: tensor or None}) asks None for requires_grad
    ("'NoneType' object has no attribute 'requires_grad'", "_combine_any_rank_results",
     "an op returned lists of different lengths on the simulated ranks (torch.chunk of shards of different "
     "lengths): LocalTensor pads the shorter with None and cannot make a LocalTensor of them"),
    # a per-rank size (LocalIntNode, a SymInt's node) asked what only a symbolic shape answers: indexing with a
    # boolean mask whose length differs between the ranks (MaskPartial's buffer over uneven shards)
    ("'torch._C._SymNode' object has no attribute", "",
     "a per-rank size (LocalIntNode) lacks a SymNode method torch asks of it (statically_known_true, ...)"),
)


def local_tensor_error(verdict) -> str | None:
    """Why a simulated verdict ended in one of LocalTensor's own errors (LOCAL_TENSOR_ERRORS), or None."""
    if not verdict.is_finding or verdict.error is None:
        return None
    e = verdict.error_record
    message, where = e.message or "", e.traceback or ""
    return next((why for text, frame, why in LOCAL_TENSOR_ERRORS if text in message and frame in where), None)


def simulated_session():
    """fuzz --simulate's Session class: its book sets LocalTensor's own errors
    aside, unshrunk, for the real-process check (``SimulatedBook``)."""
    from ..findings.life import FindingBook, _smaller
    from .engine import Session

    class SimulatedBook(FindingBook):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.set_aside: dict = {}  # signature -> (its smallest case, verdict, why, hits)

        def accept(self, sig: str, case, verdict) -> bool:
            why = local_tensor_error(verdict)
            held = self.set_aside.get(sig)
            if why is None or sig in self.tracks:
                return super().accept(sig, case, verdict)
            if held is None:
                self._say(f"{sig}: LocalTensor's own error ({why}): not shrunk, set aside for the real-process "
                          f"check at the session's end")
            hits = held[3] + 1 if held else 1
            best = (case, verdict) if held is None or _smaller(case, held[0]) else held[:2]
            self.set_aside[sig] = (*best, why, hits)
            return False

    class SimulatedSession(Session):
        def _new_book(self, *args, **kwargs):
            return SimulatedBook(*args, **kwargs)

    return SimulatedSession


# -- the driver side: confirming on real process groups ------------------------------------------------
def confirm(findings: list, out: str | Path, args, progress=sys.stderr, set_aside: dict | None = None) -> dict:
    """Each simulated finding's case run on real gloo process groups (fresh
    workers, its own world size) where it fits this machine (<= REAL_MAX):
      * the same signature: confirmed, its file says so (``simulation``);
      * anything else: a LocalTensor limitation (or a harness one), its files
        moved to OUT/simulation_limits/ with what the real run said;
      * larger than REAL_MAX: "simulated only", its file says so.
    Returns {"confirmed": [...], "limits": [...], "simulated_only": [...]} (signatures).

    Before that, each finding's world size and mesh are shrunk, simulated, as
    far as its signature allows (``least_worlds``: its file's case is then the
    least case that fails, and what it checked on real processes); after it,
    findings that are one bug met in several modules are folded into one file
    (``fold_one_bug``: then the result also holds "folded", signature -> the
    finding it is a face of).

    ``set_aside`` (SimulatedBook's: signature -> (case, verdict, why, hits)):
    LocalTensor's own errors, unshrunk, each run on real processes too: the
    same signature there makes it a finding after all; another finding there
    that is not a known one is written as a finding of its own (the real
    run's signature: a real bug the simulated run only stumbled over); else
    (a pass, a known bug) it goes to OUT/simulation_limits/. Then the result
    also holds "set_aside" (signatures) and "found" (the Findings written).
    A real run that gives a finding already written in ``out`` leaves its file
    as it is (shrunk, confirmed): "met" says signature -> that finding."""
    from ..findings.record import atomic_write, load_known

    known = load_known()
    out = Path(out)
    result: dict = {"confirmed": [], "limits": [], "simulated_only": []}
    onsets = least_worlds(findings, out, args, known, progress)
    for f in findings:
        path = out / f"{f.signature}.json"
        data = json.loads(path.read_text()) if path.exists() else f.to_dict()
        w = f.case.ranks
        if w > REAL_MAX:
            f.stage = data["stage"] = SIMULATED_ONLY  # what the session's FINDING line and index say of it
            data["simulation"] = {"status": SIMULATED_ONLY, "world_size": w,
                                  "why": f"{w} ranks: more than the {REAL_MAX} this machine runs for real"}
            atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
            result["simulated_only"].append(f.signature)
            print(f"fuzzshard: {f.signature}: SIMULATED ONLY (world size {w} > {REAL_MAX})", file=progress)
            continue
        print(f"fuzzshard: {f.signature}: confirming on {w} real gloo processes", file=progress, flush=True)
        j, env, real = _judge_for_real(f.case, args, known)
        if j.signature == f.signature:
            data["simulation"] = {"status": "confirmed on real process groups", "real": real}
            atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
            result["confirmed"].append(f.signature)
            print(f"fuzzshard: {f.signature}: CONFIRMED on {w} real processes", file=progress)
        else:
            limits = out / LIMITS
            limits.mkdir(parents=True, exist_ok=True)
            data["simulation"] = {"status": "LocalTensor limitation: not reproduced on real process groups",
                                  "real": real}
            atomic_write(limits / f"{f.signature}.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
            if (out / f"{f.signature}.py").exists():
                shutil.move(out / f"{f.signature}.py", limits / f"{f.signature}.py")
            path.unlink(missing_ok=True)
            result["limits"].append(f.signature)
            print(f"fuzzshard: {f.signature}: not a finding: real processes give {j.label} "
                  f"-> {limits}/{f.signature}.json (a LocalTensor limitation)", file=progress)
            if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
                result.setdefault("met", {})[f.signature] = j.signature  # a finding already written: its file kept
            elif j.verdict.is_finding and not j.known:  # the real run fails otherwise, with no known bug: a finding
                found = _write_real(out, f.case, j, env, f"found on real process groups through the simulated "
                                    f"finding {f.signature}, which LocalTensor shows otherwise", real)
                result.setdefault("found", []).append(found)
                print(f"fuzzshard: {f.signature}: real processes give a NEW finding {j.signature} "
                      f"-> {out}/{j.signature}.json", file=progress)
    folded = fold_one_bug([f for f in findings if f.signature not in result["limits"]], onsets, out, progress)
    if folded:
        result["folded"] = folded
        for key in ("confirmed", "simulated_only"):
            result[key] = [s for s in result[key] if s not in folded]
    if set_aside:
        result.update(set_aside=[], found=[])
        _confirm_set_aside(set_aside, out, args, result, progress)
    return result


# -- the driver side: each simulated finding at the least world its bug needs ------------------------------
# A session shrinks a finding as any session does (Hypothesis, then reduce.py),
# within its time; the reducer's world edits keep a 2-D mesh's first dim only.
# Here, after the session and before the real check, a finding's world is
# shrunk once more, simulated, with no deadline: every smaller mesh, each
# keeping any of the case's mesh dims (its placements with it), least first.
ONSET_ABOVE = 2  # a bug that begins at more ranks than this on a 1-D mesh, and at no fewer, has an onset (fold_one_bug)


def world_shrinks(case) -> list[tuple[list[str], object]]:
    """Every smaller world and mesh of ``case`` (no checkpoint: a simulated
    session draws none), least first: fewer ranks, then fewer mesh dims (the
    1-D mesh of the same world too). A new mesh keeps some of the case's mesh
    dims, each at most its size; a param's placements keep those dims'. Each
    with what it changed ("world size 16 -> 6", "mesh [8, 2] -> [6]")."""
    import itertools
    import math

    from ..case import Case

    if case.checkpoint:
        return []
    shape, world = list(case.mesh_shape), case.ranks
    out, seen = [], {case.to_json()}
    for k in range(1, len(shape) + 1):
        for kept in itertools.combinations(range(len(shape)), k):
            for mesh in itertools.product(*(range(1 if k == 1 else 2, shape[d] + 1) for d in kept)):
                mesh = list(mesh)
                ranks = math.prod(mesh)
                if ranks > world or (ranks == world and k >= len(shape)):
                    continue
                try:
                    smaller = Case.from_dict(_projected(case.to_dict(), kept, mesh))
                    smaller.check_world()
                except Exception:  # a mesh the case's options cannot take: not tried
                    continue
                if smaller.to_json() in seen:
                    continue
                seen.add(smaller.to_json())
                what = ([f"world size {world} -> {ranks}"] if ranks < world else []) + \
                       ([f"mesh {shape} -> {mesh}"] if mesh != [ranks] or len(shape) > 1 else [])
                out.append((ranks, k, what, smaller))
    out.sort(key=lambda t: (t[0], t[1]))
    return [(what, c) for _, _, what, c in out]


def _projected(data: dict, kept: tuple, mesh: list) -> dict:
    """``data`` on ``mesh``, whose dims are the case's ``kept`` ones: placements per mesh dim picked, then
    reduce.py's re-fitting (options, batch) to that mesh."""
    from ..findings.reduce import _reworld

    placements = data["target_options"].get("placements")
    if placements:
        data["target_options"]["placements"] = {n: [p[d] for d in kept] for n, p in placements.items()}
    return _reworld(data, False, mesh)


def least_worlds(findings: list, out: Path, args, known: dict, progress=sys.stderr) -> dict:
    """Each finding's world size and mesh shrunk, simulated, to the least that
    gives its signature (``world_shrinks``, judged side by side), its files
    rewritten so (case, verdict, script, ``removed``) and its generalization
    table made anew for that case (generalize.py), with the 1-D world sizes
    around its onset as rows. Returns signature -> its onset (the least 1-D
    world size it fails from, or None: see fold_one_bug)."""
    from ..findings.generalize import Face, generalize
    from ..findings.judge import judge_many

    todo = [f for f in findings if f.verdict is not None and f.verdict.oracle not in ("hang", "crash")
            and f.stage not in ("provisional", "unconfirmed")]
    if not todo:
        return {}
    pool = start_simulated(args)
    onsets: dict = {}
    try:
        for f in todo:
            tried: dict = {}  # case JSON -> its judgement

            def judged(cases: list) -> list:
                new = [c for c in cases if c.to_json() not in tried]
                for c, j in zip(new, judge_many(pool, new, known) if new else []):
                    tried[c.to_json()] = j
                return [tried[c.to_json()] for c in cases]

            least = _least(f, judged, pool.size)
            table = [Face(**row) for row in f.generalization]
            if least is not None:
                what, f.case, f.verdict = least
                f.removed = [r for r in f.removed if r not in what] + what
                print(f"fuzzshard: {f.signature}: shrunk simulated to {f.case.ranks} ranks on "
                      f"{list(f.case.mesh_shape)} ({', '.join(what)})", file=progress, flush=True)
                table, faces = generalize(judged, f.case, f.verdict, _optimizer_names(args))  # the table of this case
                f.faces = sorted((set(f.faces) | faces) - {f.signature})
            onsets[f.signature], rows = _onset(f, judged)
            f.generalization = [row.to_dict() for row in table if not row.dimension.startswith("world size")] + \
                [row.to_dict() for row in rows]
            _rewrite(out, f)
    finally:
        pool.close()
    return onsets


def _least(f, judged, batch: int):
    """(what changed, the least case, its verdict) of ``f``'s smaller worlds that give its signature, or None."""
    shrinks = world_shrinks(f.case)
    for at in range(0, len(shrinks), max(1, batch)):
        chunk = shrinks[at:at + max(1, batch)]
        hit = next(((what, c, j.verdict) for (what, c), j in zip(chunk, judged([c for _, c in chunk]))
                    if j.label == f.signature), None)
        if hit is not None:
            return hit
    return None


def _onset(f, judged) -> tuple:
    """(T, rows): ``f``'s case on 1-D meshes of T .. its own ranks fails (the same oracle, a new bug: the
    signature may change with the world size, where another module is the first wrong) and passes on T - 1,
    T > ONSET_ABOVE; and the same case with every width scaled so that each shard is even at T - 1 and at T
    ranks (``_widened``) does not say otherwise (it fails so at T - 1, or passes at T: then the shapes made
    the onset, an uneven or empty shard, not the group size; a known bug there says nothing). A bug that
    begins at a group size. Else (None, rows). rows: generalize.Face rows of the world sizes tried."""
    import math

    from ..findings.generalize import Face

    n = f.case.ranks
    if len(f.case.mesh_shape) != 1 or n <= ONSET_ABOVE:
        return None, []

    def fails_so(j) -> bool:
        return j is not None and j.verdict.is_finding and not j.known and j.verdict.oracle == f.verdict.oracle

    sizes = [w for w in range(ONSET_ABOVE, n + 2) if w != n]
    tried = {w: c for w in sizes if (c := _resized(f.case, w)) is not None}
    seen = dict(zip(tried, judged(list(tried.values()))))
    t = n
    while t - 1 in seen and t - 1 > ONSET_ABOVE and fails_so(seen[t - 1]):
        t -= 1
    rows = [Face("world size (1-D mesh)", str(n), "fails", f.signature)]
    for w, j in sorted(seen.items()):
        if t - 1 <= w:
            rows.append(_row("world size (1-D mesh)", w, j, f.signature))
    rows.sort(key=lambda r: int(r.value))
    below = seen.get(t - 1)
    if t <= ONSET_ABOVE or below is None or below.verdict.status != "pass":
        return None, rows
    wide = _widened(f.case, math.lcm(t - 1, t))
    if wide is None:
        return t, rows
    dim = f"world size, widths x{wide[1]} (every shard even)"
    pair = [c for c in (_resized(wide[0], t - 1), _resized(wide[0], t)) if c is not None]
    if len(pair) < 2:
        return t, rows
    under, at = judged(pair)
    rows += [_row(dim, t - 1, under, f.signature), _row(dim, t, at, f.signature)]
    shapes_say = fails_so(under) or at.verdict.status == "pass"
    return (None if shapes_say else t), rows


def _row(dimension: str, w: int, j, sig: str):
    """A generalize.Face row: what the case gave at ``w`` ranks."""
    from ..findings.generalize import Face

    status = j.verdict.status
    outcome = ("fails" if j.label == sig else "fails otherwise" if status == "finding" else
               {"pass": "passes", "invalid": "invalid"}.get(status, "error"))
    return Face(dimension, str(w), outcome, j.label if status == "finding" else "")


WIDE_MAX = 512  # the widest layer _widened makes (a Linear of 512x512 is a small case still)


def _widened(case, even: int):
    """(``case`` with every width of its model times k, k) where k is the least that makes every width a
    multiple of ``even``, or None (a plugin's model, wider than WIDE_MAX, or a case that cannot be)."""
    import math

    from ..case import Case

    data = case.to_dict()
    model = data["model"]
    if model.get("factory"):
        return None
    widths, stack = [model["d_in"]], list(model["layers"])
    while stack:
        layer = stack.pop()
        widths += [w for w in (layer["d_in"], layer["d_out"]) if w]
        stack += layer["children"]
    k = math.lcm(*(even // math.gcd(w, even) for w in widths))
    if k == 1 or max(widths) * k > WIDE_MAX:
        return None if k != 1 else (case, 1)

    def scale(layer):
        layer.update(d_in=layer["d_in"] * k, d_out=layer["d_out"] * k)
        for child in layer["children"]:
            scale(child)

    model["d_in"] *= k
    for layer in model["layers"]:
        scale(layer)
    try:
        wide = Case.from_dict(data)
        wide.check_world()
        return wide, k
    except Exception:
        return None


def _resized(case, w: int):
    """``case`` (1-D) on a 1-D mesh of ``w`` ranks, or None where it cannot be."""
    from ..case import Case

    try:
        c = Case.from_dict(_projected(case.to_dict(), (0,), [w]))
        c.check_world()
        return c
    except Exception:
        return None


def _optimizer_names(args) -> list | None:
    """What generalizing may swap in: the session's --optimizers, else the defaults (generalize.variants)."""
    text = getattr(args, "optimizers", None)
    return [o.strip() for o in text.split(",") if o.strip()] if text else None


def _rewrite(out: Path, f) -> None:
    """``f``'s files as ``f`` says now (its case, verdict, script), whatever the session wrote."""
    from ..findings import repro
    from ..findings.record import summary, write_finding

    write_finding(out, f, repro.script(f.case, summary(f.verdict), f.environment, verdict=f.verdict), replace=True)


def fold_one_bug(findings: list, onsets: dict, out: Path, progress=sys.stderr) -> dict:
    """One bug, one file: findings of one target and oracle that begin at the
    same group size (``onsets``, see _onset: least at T ranks on a 1-D mesh,
    and with every shard even, passing at T - 1 and failing at T) are one bug
    met in several modules (a Partial sum wrong over T+ ranks shows in a
    Linear, an Embedding, a LayerNorm, forward or backward): the least case
    keeps its file, the others become its faces (their signatures, and their
    cases under ``simulation.folded``) and their files go. Returns
    signature -> the finding it was folded into."""
    from ..findings.life import _smaller
    from ..findings.record import atomic_write

    groups: dict = {}
    for f in findings:
        t = onsets.get(f.signature)
        if t is not None and (out / f"{f.signature}.json").exists():
            groups.setdefault((f.case.target, f.verdict.oracle, t), []).append(f)
    folded: dict = {}
    for (_, _, t), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        members.sort(key=lambda m: (m.case.ranks, len(m.case.to_json()), m.signature))
        owner, rest = members[0], members[1:]
        path = out / f"{owner.signature}.json"
        data = json.loads(path.read_text())
        owner.faces = sorted(set(owner.faces) | {s for m in rest for s in [m.signature, *m.faces]} - {owner.signature})
        data["faces"] = owner.faces
        data.setdefault("simulation", {})["folded"] = [  # each face's own case and what real processes said of it
            {"signature": m.signature, "onset": t, "case": json.loads(m.case.to_json()), "summary": m.summary,
             "simulation": json.loads((out / f"{m.signature}.json").read_text()).get("simulation")} for m in rest]
        atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        for m in rest:
            folded[m.signature] = owner.signature
            for suffix in (".json", ".py"):
                (out / f"{m.signature}{suffix}").unlink(missing_ok=True)
            print(f"fuzzshard: {m.signature}: another face of finding {owner.signature} (both begin at {t} ranks on a "
                  f"1-D mesh, passing on {t - 1}: a group size, not their shapes), folded into it", file=progress)
    return folded


def start_simulated(args, size: int | None = None):
    """A simulated pool (LocalTensorMode workers) for the driver's own checks, side by side where it can."""
    from ..cli.common import start_pool

    n = size or getattr(args, "simulate_workers", None) or max(1, min(2, os.cpu_count() or 1))
    return start_pool(argparse.Namespace(**{**vars(args), "simulate": True}), n, placed=True)


def _judge_for_real(case, args, known) -> tuple:
    """``case`` judged on fresh real gloo processes, as many as its ranks: (the judgement, the environment,
    what the finding's file records of the real run)."""
    from ..cli.common import start_pool
    from ..findings.judge import judge
    from ..findings.record import environment, summary

    pool = start_pool(argparse.Namespace(**{**vars(args), "simulate": False}), case.ranks)  # real gloo processes
    try:
        j = judge(pool, case, known)
        env = environment(pool.info, pool.options["backend"], pool.options["device"])
    finally:
        pool.close()
    real = {"signature": j.signature, "status": j.verdict.status, "world_size": case.ranks, "known": j.known,
            "seconds": round(j.seconds, 3)}
    if j.verdict.is_finding:
        real["summary"] = summary(j.verdict)
    return j, env, real


def _confirm_set_aside(set_aside: dict, out: Path, args, result: dict, progress) -> None:
    from ..findings.record import atomic_write, load_known, summary

    known = load_known()
    limits = out / LIMITS
    for sig, (case, verdict, why, hits) in sorted(set_aside.items()):
        w = case.ranks
        result["set_aside"].append(sig)
        data = {"signature": sig, "summary": summary(verdict), "case": json.loads(case.to_json()),
                "verdict": verdict.to_dict(), "stage": "set aside unshrunk", "hits": hits}
        if w > REAL_MAX:  # only the world size is shrunk: to the largest 1-D world <= REAL_MAX that fails the same
            smaller = _real_sized(case, sig, args)
            if smaller is None:
                data["simulation"] = {"status": f"LocalTensor's own error ({why}); {SIMULATED_ONLY}: {w} ranks, and "
                                                f"no 1-D world of <= {REAL_MAX} ranks fails the same way simulated"}
                limits.mkdir(parents=True, exist_ok=True)
                atomic_write(limits / f"{sig}.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
                result["limits"].append(sig)
                print(f"fuzzshard: {sig}: LocalTensor's own error, {SIMULATED_ONLY} ({w} ranks; none of <= {REAL_MAX} "
                      f"fails the same way) -> {limits}/{sig}.json", file=progress)
                continue
            data.update(removed=[f"world size {w} -> {smaller.ranks}"], case=json.loads(smaller.to_json()))
            case, w = smaller, smaller.ranks
        print(f"fuzzshard: {sig}: LocalTensor's own error, {hits} case(s); its smallest on {w} real gloo processes",
              file=progress, flush=True)
        j, env, real = _judge_for_real(case, args, known)
        if j.verdict.is_finding and not j.known and (out / f"{j.signature}.json").exists():
            # a finding already written (this session's, shrunk and confirmed: e.g. replicas that diverged, which a
            # later .item() or float(loss) of them turns into LocalTensor's own error): one more case of it, kept as is
            result.setdefault("met", {})[sig] = j.signature
            print(f"fuzzshard: {sig}: real processes give {j.signature}, a finding already in {out} (its file kept)",
                  file=progress)
            continue
        if j.verdict.is_finding and not j.known:  # a real finding: the same signature, or a real bug of its own
            f = _write_real(out, case, j, env, "confirmed on real process groups" if j.signature == sig else
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
        limits.mkdir(parents=True, exist_ok=True)
        atomic_write(limits / f"{sig}.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
        result["limits"].append(sig)
        print(f"fuzzshard: {sig}: not a finding: real processes give {j.label}{' (known)' if j.known else ''} "
              f"-> {limits}/{sig}.json (a LocalTensor limitation)", file=progress)


def _write_real(out: Path, case, j, env: dict, status: str, real: dict):
    """OUT/<the real run's signature>.json + .py: what real processes gave for a simulated case."""
    from ..findings import repro
    from ..findings.record import Finding, atomic_write, summary, write_finding

    f = Finding(j.signature, case, j.verdict, environment=env, stage="confirmed")
    d = f.to_dict()
    d["simulation"] = {"status": status, "real": real}
    write_finding(out, f, repro.script(case, summary(j.verdict), env, verdict=j.verdict))
    atomic_write(out / f"{f.signature}.json", json.dumps(d, indent=2, sort_keys=True) + "\n")
    return f


def _real_sized(case, sig: str, args):
    """``case`` on the largest 1-D world of at most REAL_MAX ranks (reduce.py's world edits) that still gives
    ``sig`` simulated, or None: what a set-aside case larger than this machine's real runs is checked as."""
    from ..case import Case
    from ..cli.common import start_pool
    from ..findings.judge import judge
    from ..findings.reduce import _world_edits

    tries = []
    for what, data in _world_edits(json.loads(case.to_json())):
        if data is not None and what.startswith("world size") and data["world_size"] <= REAL_MAX:
            try:
                tries.append(Case.from_dict(data))
            except Exception:  # an edit the case's options cannot take: not tried
                continue
    tries.sort(key=lambda c: -c.ranks)
    pool = start_pool(argparse.Namespace(**{**vars(args), "simulate": True}), 1)
    try:
        return next((c for c in tries if judge(pool, c).signature == sig), None)
    finally:
        pool.close()


# -- bench --simulate -----------------------------------------------------------------------------------
def run_bench(n: int, seed: int, target: str = "dtensor", echo=print, real_worlds=(2, 4, 8),
              sim_worlds=(2, 4, 8, 16, 64), workers: int | None = None) -> dict:
    """Cases/s of the same cases simulated (one worker; and ``workers`` side
    by side, as a simulated session runs them) and real (a warm gloo pool of
    W processes, one case at a time), per world size. Each pool runs one
    untimed case of the size first (imports, torch's per-shape caches).
    Beside the wall clock, the CPU seconds its worker processes spent per
    case: on a machine others load, W real processes get W shares of the
    cores and one simulated worker one share, so the CPU ratio is what an
    idle machine's wall clock would give (side by side, one case per core)."""
    import time

    from .bench import fixed_cases
    from ..pool.runner import Pool

    workers = workers or max(1, os.cpu_count() or 1)
    out: dict = {}
    echo(f"bench --simulate: {n} {target} cases per world size (seed {seed}); real: a warm pool of W gloo "
         f"processes; simulated: LocalTensorMode in one worker, and in {workers} side by side")
    for w in sorted(set(real_worlds) | set(sim_worlds)):
        *cases, spare = fixed_cases(n + 1, w, seed, target)
        row: dict = {}
        sides = ([("real", dict(size=w), False)] if w in real_worlds else []) + \
                ([("sim1", dict(size=1, simulate=True), False)] + ([("simN", dict(size=workers, simulate=True), True)]
                                                                    if workers > 1 else []) if w in sim_worlds else [])
        for name, kwargs, side_by_side in sides:
            with Pool(case_timeout=600, spare=False, placed=side_by_side, **kwargs) as pool:
                pool.run_many([spare] * (pool.size if kwargs.get("simulate") else 1))  # every worker warm
                t0, cpu0 = time.perf_counter(), _cpu_seconds(pool)
                results = pool.run_many(cases) if side_by_side else [pool.run(c) for c in cases]
                seconds, cpu1 = time.perf_counter() - t0, _cpu_seconds(pool)
            # a worker replaced after a crash took what it spent with it: then the CPU is a lower bound
            cpu, lost = sum(t - cpu0.get(pid, 0.0) for pid, t in cpu1.items()), not cpu0.keys() <= cpu1.keys()
            statuses = collections_counter(r.verdict.status for r in results)
            row[name] = {"cases_per_s": len(cases) / seconds, "seconds": seconds, "statuses": statuses,
                         "cpu_per_case": cpu / len(cases), "cpu_lower_bound": lost}
            echo(f"  W={w:<3} {name:5} {len(cases) / seconds:7.2f} cases/s  ({seconds:.1f}s, CPU {'>=' if lost else ''}"
                 f"{cpu / len(cases):.2f}s a case; {', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))})")
        if "real" in row and "sim1" in row:
            best = max(row["sim1"]["cases_per_s"], row.get("simN", row["sim1"])["cases_per_s"])
            echo(f"  W={w:<3} simulated / real: {best / row['real']['cases_per_s']:.2f}x wall clock, "
                 f"{'>=' if row['real']['cpu_lower_bound'] else ''}"
                 f"{row['real']['cpu_per_case'] / row['sim1']['cpu_per_case']:.2f}x CPU a case")
        out[w] = row
    return out


def _cpu_seconds(pool) -> dict:
    """pid -> user + system CPU seconds each worker process of the pool has spent so far (Linux's /proc)."""
    out = {}
    for proc in pool.procs:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (name)"
        out[proc.pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in ticks
    return out


def collections_counter(items) -> dict:
    import collections

    return dict(collections.Counter(items))
