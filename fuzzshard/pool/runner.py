"""The driver side of the worker pool.

Workers are spawned once per session and form one real process group
(gloo on CPU, NCCL on GPUs). ``Pool.run(case)`` sends the case to ranks
0..W-1 (W: the larger of a checkpoint's saving and loading world) and waits at
most ``case_timeout`` seconds; ``Pool.run_many(cases)`` runs several side by
side on disjoint ranks of a ``placed`` pool. A rank that never answers
makes a ``hang`` verdict, a rank that dies a ``crash`` verdict; either way the
pool is torn down and rebuilt, and the session goes on.
"""
from __future__ import annotations

import json
import multiprocessing.connection as mpc
import os
import re
import secrets
import select
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

from .. import oracle as oracles  # what a finding of each oracle is (no branch on its name here)
from ..case import Case
from .message import Exit, Ready, RunCase
from .options import CASE_TIMEOUT, PoolOptions
from ..verdict import ErrorRecord, Status, Verdict, failure, finding

START_TIMEOUT = 300.0
# Once one rank has raised, the others are usually stuck in a collective
# waiting for it: give them this long to report, not the whole case timeout.
# Ranks that raise the same error usually report close together; a wait
# for ranks that never come is pure loss (1 s cost a 60 s dtensor session
# 8 s over 8 restarts, 0.25 s costs 2 s), so keep it short.
GRACE_AFTER_ERROR = 0.25
# A stuck rank's stack is read this many times (half a second apart): where it stays is the deepest frame
# in all of them (a rank slow in a loop shows another innermost frame at each look)
STACK_SAMPLES = 3


class PoolError(RuntimeError):
    """The pool could not start (bad setup file, backend unavailable, ...)."""


class LostRank(PoolError):
    """A rank of a cell spanning processes went away with its process or node:
    the end of that cell, never a finding."""


@dataclass
class Result:
    verdict: Verdict
    seconds: float
    timings: dict = field(default_factory=dict)
    offset: int = 0  # the pool rank the case's rank 0 ran on


class Pool:
    def __init__(
        self,
        size: int,
        options: PoolOptions | None = None,
        log_dir: str | None = None,
        spare: bool = True,
        device_offset: int = 0,
        link=None,
        scratch: str | None = None,
        zygote: bool = True,
        placed: bool = False,
    ):
        """``options`` (options.py: what the command line said; None: PoolOptions()'s defaults); the rest is
        the pool's to decide."""
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        options = options or PoolOptions()
        self.size = size
        self.case_timeout = options.case_timeout
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="fuzzshard-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        simulated = options.simulate  # --simulate (kernel/simulated.py): each worker runs a whole case alone
        self.options = replace(
            options, device_offset=device_offset, log_dir=self.log_dir,
            backend="fake" if simulated else options.backend or ("nccl" if options.device == "cuda" else "gloo"),
            # a collective stuck past this raises inside the worker; the driver gives up sooner
            collective_timeout=max(60.0, 2 * options.case_timeout),
            zygote=zygote and os.environ.get("FUZZSHARD_ZYGOTE", "1") != "0",
            placed=simulated or (placed and size > 1))  # simulated cases run side by side, one per worker
        # a cell spanning processes (span.Link): ranks from link.local on are
        # spawned elsewhere; it has no spare set, and its checkpoints go to a
        # scratch folder every node sees
        self.link = link
        self.scratch = scratch
        self.lost: str | None = None
        self.spare_enabled = spare and link is None
        self.gen: _Generation | None = None
        self.spare: _Generation | None = None
        self.info: dict = {}
        self.restarts = 0  # after a hang or a crash
        self.confirmations = 0  # fresh generations started to confirm a finding
        self.restart_seconds = 0.0
        self.stuck_seconds = 0.0  # waited after a rank raised for ranks that never answered (then restarted)
        self.history: list[tuple[Case, Verdict]] = []  # (case, verdict) run by the current workers, in order
        self._gens = 0

    # -- lifecycle -------------------------------------------------------
    def _launch(self) -> _Generation:
        self._gens += 1
        return _Generation(self._gens, self.size, self.options, self.log_dir, self.link)

    def start(self) -> Pool:
        self.gen = self._launch()
        self.info = self.gen.connect()
        return self

    def fresh(self) -> None:
        """Run what comes next in worker processes that have run no case (a
        finding is confirmed there: nothing a case left behind can reach it)."""
        self.confirmations += 1
        self.restart(counted=False)

    def restart(self, counted: bool = True) -> None:
        """Replace the workers (after a hang or a crash). From the first restart
        on, a spare set warms up in the background, so the next costs ~nothing
        (not before: on a small machine its start-up slows the cases)."""
        t0 = time.monotonic()
        self.gen.stop(kill=True)
        self.restarts += counted
        self.gen, self.spare = (self.spare or self._launch()), None
        try:
            self.info = self.gen.connect()
        except LostRank as e:
            self.lost = str(e)
            raise
        except PoolError:  # a spare that died while it waited: a fresh set gets one more try
            self.gen = self._launch()
            self.info = self.gen.connect()
        if self.spare_enabled:
            self.spare = self._launch()
        self.restart_seconds += time.monotonic() - t0
        self.history = []

    def stop(self) -> None:
        for g in (self.gen, self.spare):
            if g is not None:
                g.stop()
        self.gen = self.spare = None

    def close(self) -> None:
        self.stop()
        if self.link is not None:
            self.link.close()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @property
    def procs(self) -> list:
        return self.gen.procs

    @property
    def conns(self) -> list:
        return self.gen.conns

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _where_stuck(self, ranks: list[int], samples: int = STACK_SAMPLES) -> dict[int, str]:
        """Where each stuck worker waits, as "kernel function:torch function",
        from the stacks faulthandler dumps on SIGUSR1, ``samples`` times half a
        second apart (all ranks at once): the frames in every sample. A rank
        blocked in a collective shows one stack every time; one that is slow in
        a loop (a planner's search) shows another innermost frame each time, and
        the deepest frame common to all samples is where it stays, run after run."""
        dumps: dict[int, list[str]] = {r: [] for r in ranks}
        live = [r for r in ranks if self.procs[r].pid is not None]  # a rank of another process: no signal reaches it
        for _ in range(samples if live else 0):
            start = {}
            for r in live:
                try:
                    start[r] = os.path.getsize(self.gen.log_path(r))
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(0.5)
            for r, at in start.items():
                try:
                    with open(self.gen.log_path(r), errors="replace") as f:
                        f.seek(at)
                        dumps[r].append(f.read())
                except OSError:
                    pass
        return {r: _where(*dumps[r]) if dumps[r] else "" for r in ranks}

    def _where_died(self, rank: int) -> str:
        """Where a worker killed by a signal was, as _where_stuck says it: from
        the stack faulthandler dumps on a fatal signal (SIGSEGV, SIGABRT, ...),
        the last one in its log."""
        try:
            with open(self.gen.log_path(rank), "rb") as f:
                f.seek(max(0, os.path.getsize(self.gen.log_path(rank)) - 65536))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        at = text.rfind("Fatal Python error")
        return _where(text[at:]) if at >= 0 else ""

    def _phase_of(self, rank: int) -> str:
        """The phase kind a worker was in when it hung or died (kernel/run.py, _Phase), "" if unknown."""
        return _phase(self.gen.log_path(rank)) if self.gen and self.procs[rank].pid is not None else ""

    def _log_tail(self, rank: int, lines: int = 15) -> str:
        return self.gen.log_tail(rank, lines) if self.gen else ""

    # -- running ---------------------------------------------------------
    def run(self, case: Case, localize: bool = False, timeout: float | None = None, bare: bool = False) -> Result:
        """Run one case; ``localize`` also records per-module activations to
        name the first diverging module (slower; used after a divergence);
        ``bare``: its sharded training alone, nothing checked (bench's floor).
        ``timeout``: a shorter limit than ``case_timeout`` (a hang verdict then
        records it as ``timeout``, so callers can re-check it at the full one)."""
        return self.run_many([case], [timeout], localize=localize, bare=bare)[0]

    def run_many(self, cases: list[Case], timeouts: list | None = None, localize: bool = False,
                 bare: bool = False) -> list[Result]:
        """Run cases side by side on disjoint ranks, each as soon as a block of
        ranks it fits is free (in order; a smaller one may pass a larger one
        that waits), and return their results in order. A rank is free again
        once it has answered, so the next case starts there while the reporting
        rank still checks the last one against its reference. Without
        ``placed`` workers every case starts at rank 0, one at a time. A hang
        or a crash restarts the pool once the cases running beside it have
        finished (they use other ranks and groups); the rest start in the new
        workers."""
        if self.lost:
            raise LostRank(self.lost)
        for case in cases:
            if not 1 <= self._ranks(case) <= self.size:
                raise ValueError(f"case needs world size {case.ranks}, the pool has {self.size} workers")
        timeouts = timeouts or [None] * len(cases)
        queue = [_Job(i, c, (localize, bare), min(t or self.case_timeout, self.case_timeout))
                 for i, (c, t) in enumerate(zip(cases, timeouts))]
        results: list = [None] * len(cases)
        running: list[_Job] = []
        busy: dict[int, _Job] = {}  # global rank -> the job it still owes an answer
        broken = False  # a case left stuck or dead ranks: the ones beside it finish, then new workers
        try:
            while queue or running:
                for job in [] if broken else list(queue):
                    offset = self._free_block(self._ranks(job.case), busy, placeable(job.case) or self._ranks(job.case) == 1)
                    if offset is not None:
                        queue.remove(job)
                        running.append(job)
                        self._start(job, offset, busy)
                self._collect(running, busy)
                for job in [j for j in running if j.over()]:
                    running.remove(job)
                    for r in job.waiting:
                        del busy[r]
                    results[job.index] = self._finish(job)
                    broken = broken or bool(job.dead or job.waiting)
                if broken and not running:  # the cases beside it ran on other ranks and groups: kept
                    self.restart()
                    broken, busy = False, {}
        finally:
            for job in running + queue:
                job.reset()
        return results

    def _ranks(self, case: Case) -> int:
        """The workers a case takes: its ranks, or one that simulates them all (``simulate``)."""
        return 1 if self.options.simulate else case.ranks

    def _free_block(self, w: int, busy: dict, placeable: bool = True) -> int | None:
        """The lowest offset o with ranks o..o+w-1 all free (0 only, without placed workers)."""
        offsets = range(self.size - w + 1) if self.options.placed and placeable else [0]
        return next((o for o in offsets if not any(r in busy for r in range(o, o + w))), None)

    def _start(self, job: _Job, offset: int, busy: dict) -> None:
        # checkpoint files live in a per-case directory, removed whatever happens
        job.ckpt_dir = tempfile.mkdtemp(prefix="fuzzshard-ckpt-", dir=self.scratch) if job.case.checkpoint else None
        job.offset, job.t0 = offset, time.monotonic()
        job.deadline = job.t0 + job.timeout
        localize, bare = job.how
        text = job.case.to_json()
        for r in range(offset, offset + self._ranks(job.case)):
            try:
                self.conns[r].send(RunCase(text, offset, localize, job.ckpt_dir, bare))
                job.waiting.add(r)
                busy[r] = job
            except OSError:  # it died between cases
                job.dead[r - offset] = self._exit_code(r)

    def _collect(self, running: list, busy: dict) -> None:
        """Wait for the next answers (or the nearest deadline) and file them with their jobs."""
        waiting = {self.conns[r]: r for job in running for r in job.waiting}
        left = min((j.deadline for j in running), default=0.0) - time.monotonic()
        if not waiting or left <= 0 or any(j.dead for j in running):
            return
        for conn in mpc.wait(list(waiting), timeout=left):
            r = waiting[conn]
            job = busy.pop(r)
            job.waiting.discard(r)
            try:
                done = conn.recv()  # a CaseDone (message.py)
                verdict = done.verdict
                job.answers[r - job.offset] = (verdict, done.timings)
                if verdict is not None and (oracles.raised(verdict) or verdict.status == Status.INVALID):
                    job.raised_at = job.raised_at or time.monotonic()
                    job.deadline = min(job.deadline, time.monotonic() + GRACE_AFTER_ERROR)
            except (EOFError, OSError):  # the worker's socket closed: it died
                job.dead[r - job.offset] = self._exit_code(r)

    def _finish(self, job: _Job) -> Result:
        seconds = time.monotonic() - job.t0
        if job.waiting and job.raised_at is not None:
            self.stuck_seconds += time.monotonic() - job.raised_at
        verdict = self._combine(self._ranks(job.case), job.answers, job.dead, seconds, job.offset)
        if oracles.hangs(verdict) and job.timeout < self.case_timeout:
            verdict.timeout = round(job.timeout, 1)  # a shortened limit: provisional until re-run at the full one
        self.history.append((job.case, verdict))
        job.reset(keep_answers=True)
        return Result(verdict, seconds, job.answers.get(0, (None, {}))[1], job.offset)

    def _exit_code(self, r: int) -> int | None:
        if self.procs[r].pid is None:  # another process spawned it and says how it ended
            code = self.link.exit_code(self.gen.index, r)
            if code is None:  # nobody there to say: its process or node is gone
                self.lost = f"rank {r} of this cell was lost with its process (no exit code came back)"
                self.gen.stop(kill=True)
                raise LostRank(self.lost)
            return code
        try:
            return self.procs[r].wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _combine(self, w: int, answers: dict, dead: dict, seconds: float, offset: int = 0) -> Verdict:
        """One verdict from a case's ranks; ``answers``, ``dead`` and what the
        verdict says are by the case's own ranks 0..w-1 (the pool's
        offset..offset+w-1), as a run at offset 0 or under torchrun says them."""
        if dead:
            r = min(dead)
            where = {d: at for d in sorted(dead)
                     if dead[d] is not None and dead[d] < 0 and (at := self._where_died(d + offset))}
            phases = {d: p for d in sorted(dead) if (p := self._phase_of(d + offset))}
            return Verdict.from_dict(finding(
                "crash", error=ErrorRecord(_exit_name(dead[r]), f"rank {r} died",
                                           extra={"log": self._log_tail(r + offset)}).to_dict(),
                dead_ranks=sorted(dead), exitcode=dead[r], **({"where": where} if where else {}),
                **({"phase": phases} if phases else {})))
        verdicts = {r: v for r, (v, _) in answers.items() if v is not None}
        for r in sorted(verdicts):  # any fuzzshard-internal error surfaces as such
            if verdicts[r].status == Status.ERROR:
                return replace(verdicts[r], rank=r)
        for r in sorted(verdicts):  # the reference raising too makes the case invalid, stuck ranks or not
            if verdicts[r].status == Status.INVALID:
                return verdicts[r]
        # an exception on some ranks explains the others waiting, and a load that changed something
        # (seen by the reporting rank) explains an exception after it: the earliest divergence is the bug
        for r in sorted(verdicts, key=lambda r: (not verdicts[r].extra.get("then"), r)):
            if oracles.raised(verdicts[r]) or verdicts[r].extra.get("then"):
                stuck = {"stuck_ranks": sorted(set(range(w)) - set(answers))} if len(answers) < w else {}
                return replace(verdicts[r], rank=r, extra={**verdicts[r].extra, **stuck})
        if len(answers) < w:
            stuck = sorted(set(range(w)) - set(answers))
            where = {r - offset: w for r, w in self._where_stuck([r + offset for r in stuck]).items()}
            phases = {r: p for r in stuck if (p := self._phase_of(r + offset))}
            waits = "; ".join(f"rank {r}: {where[r] or '?'}" for r in stuck)
            return Verdict.from_dict(finding(
                "hang", error=ErrorRecord("Hang", f"ranks {stuck} still running after {seconds:.0f}s, in "
                                          + waits).to_dict(), stuck_ranks=stuck, where=where,
                **({"phase": phases} if phases else {})))
        return verdicts.get(0) or Verdict.from_dict(failure("rank 0 returned no verdict"))



def placeable(case: Case) -> bool:
    """Whether a case may run at an offset: its meshes are 1-D (kernel/mesh.py, Meshes.mesh, says why)."""
    ck = case.checkpoint
    return len(case.mesh_shape) == 1 and (ck is None or len(ck.mesh_shape) == 1)


@dataclass(eq=False)
class _Job:
    """One case of a run_many call: where it runs and what its ranks said."""
    index: int
    case: Case
    how: tuple  # (localize, bare)
    timeout: float
    offset: int = 0
    t0: float = 0.0
    deadline: float = 0.0
    raised_at: float | None = None  # when its first rank raised
    ckpt_dir: str | None = None
    waiting: set = field(default_factory=set)  # pool ranks that owe an answer
    answers: dict = field(default_factory=dict)  # case rank -> (verdict, timings)
    dead: dict = field(default_factory=dict)  # case rank -> exit code

    def over(self) -> bool:
        return not self.waiting or bool(self.dead) or time.monotonic() >= self.deadline

    def reset(self, keep_answers: bool = False) -> None:
        """Its checkpoint folder removed; unless ``keep_answers``, as if never started."""
        if self.ckpt_dir:
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            self.ckpt_dir = None
        if not keep_answers:
            self.waiting, self.answers, self.dead, self.raised_at = set(), {}, {}, None


class _Generation:
    """One set of worker processes forming one process group. They join their
    process group, then connect back over an authenticated socket."""

    def __init__(self, index: int, size: int, options: PoolOptions, log_dir: str, link=None):
        self.index, self.size, self.log_dir, self.link = index, size, log_dir, link
        self.store_dir = tempfile.mkdtemp(prefix="fuzzshard-store-")
        authkey = secrets.token_bytes(16).hex()
        # backlog: every worker's connect completes at once, even while nobody
        # accepts (a spare set waits for its turn; with the default backlog of 1
        # the others' SYNs are dropped and their connect() times out after ~2 min)
        host = link.host if link else "127.0.0.1"
        self.listener = mpc.Listener((host, 0), backlog=size, authkey=bytes.fromhex(authkey))
        store = link.worker_store(index) if link else os.path.join(self.store_dir, "store")
        opts = {**options.to_worker(), "size": size, "address": self.listener.address, "store": store}
        local = link.local if link else size
        self.procs = [spawn_worker(opts, rank, authkey, self.log_path(rank)) for rank in range(local)]
        self.procs += [_Remote() for _ in range(local, size)]
        self.conns = [None] * size
        if link:  # the other processes of the cell start their ranks of this generation
            link.announce(index, opts, authkey)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"gen{self.index}-rank{rank}.log")

    def connect(self) -> dict:
        """Wait until every worker is ready; PoolError with its log if one is not."""
        info = {}
        try:
            for _ in range(self.size):
                conn = self._accept()
                ready: Ready = conn.recv()
                self.conns[ready.rank], info = conn, ready.info
        except LostRank:
            self.stop(kill=True)
            raise
        except (OSError, EOFError, PoolError) as e:
            tail = next((t for t in (self.log_tail(r) for r in range(self.size)) if t), "")
            self.stop(kill=True)
            raise PoolError(f"workers did not start: {e}\n{tail}") from None
        finally:
            self.listener.close()
        return info

    def _accept(self):
        """accept(), but give up when a worker exits first or time runs out."""
        sock = self.listener._listener._socket  # the stdlib exposes no timeout on accept()
        deadline = time.monotonic() + START_TIMEOUT
        while not select.select([sock], [], [], 0.5)[0]:
            if any(p.poll() is not None for p in self.procs):
                raise PoolError("a worker exited before it was ready")
            if self.link is not None and self.link.lost():  # its ranks on another node will never come
                raise LostRank("ranks of this cell were lost with their process (its heartbeat stopped while a "
                               "new generation started)")
            if time.monotonic() > deadline:
                raise PoolError(f"workers not ready within {START_TIMEOUT:.0f}s")
        return self.listener.accept()

    def stop(self, kill: bool = False) -> None:
        kill = kill or any(c is None for c in self.conns)  # not connected: it cannot hear "exit"
        for conn in self.conns:
            if conn is not None and not kill:
                try:
                    conn.send(Exit())
                except OSError:
                    pass
        for p in self.procs:
            if kill and p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.listener.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
        for rank in range(self.size):
            for path in (self.log_path(rank), phase_path(self.log_path(rank))):
                try:
                    os.remove(path)
                except OSError:
                    pass

    def log_tail(self, rank: int, lines: int = 15) -> str:
        try:
            with open(self.log_path(rank)) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def spawn_worker(options: dict, rank: int, authkey: str, log_path: str):
    """One worker, forked by this process's zygote (zygote.py: torch is
    imported there once, not per worker), its output appended to
    ``log_path``; a Popen-like handle. If the zygote cannot start, a plain
    ``python -m fuzzshard.pool.worker`` (multiprocessing's spawn would re-import
    the caller's __main__)."""
    env = {**os.environ, "FUZZSHARD_AUTHKEY": authkey, "OMP_NUM_THREADS": "1",
           "FUZZSHARD_WORKER": json.dumps({**options, "rank": rank}), "FUZZSHARD_PHASE": phase_path(log_path)}
    if options.get("zygote"):
        from .zygote import zygote

        try:
            return zygote().spawn(env, log_path)
        except (OSError, EOFError):
            pass
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fuzzshard.pool.worker"], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


class _Remote:
    """A rank of this cell that another process spawns and kills (span.py)."""

    pid = None

    def poll(self):
        return None

    def kill(self) -> None:
        pass

    def wait(self, timeout=None):
        return None


def phase_path(log_path: str) -> str:
    """Where a worker writes the kind of phase it is in (kernel/run.py, _Phase), beside its log."""
    return log_path[:-4] + ".phase" if log_path.endswith(".log") else log_path + ".phase"


def _phase(log_path: str) -> str:
    """The phase kind a worker last wrote ("fwdbwd", "load", ...), "" if none: what a hang's or a crash's
    signature names, so that it never moves with fuzzshard's own module or function names."""
    try:
        with open(phase_path(log_path), "rb") as f:
            return f.read(16).decode(errors="replace").strip()
    except OSError:
        return ""


_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\S+)')  # a faulthandler frame: (path, function)


def _where(dump: str, *more: str) -> str:
    """A faulthandler stack dump (innermost frame first) as "kernel
    function:innermost torch function": what a hang or a crash signature names.
    ``more``: other dumps of the same thread; only frames in all of them count."""
    frames = _FRAME.findall(dump)
    for other in more:
        common = set(_FRAME.findall(other))
        frames = [f for f in frames if f in common]
    kernel = f"{os.sep}fuzzshard{os.sep}kernel{os.sep}"
    ours = next((f"{os.path.basename(p)[:-3]}.{fn}" for p, fn in frames if kernel in p), "")
    theirs = next((fn for p, fn in frames if f"{os.sep}torch{os.sep}" in p), "")
    return f"{ours}:{theirs}" if ours or theirs else ""


def _exit_name(code) -> str:
    if code is None:
        return "Crash"
    if code < 0:
        import signal

        try:
            return f"Killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"Killed by signal {-code}"
    return f"Exit {code}"
