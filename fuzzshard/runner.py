"""The driver side of the worker pool.

Workers are spawned once per session and form one real process group
(gloo on CPU, NCCL on GPUs). ``Pool.run(case)`` sends the case to ranks
0..W-1 and waits at most ``case_timeout`` seconds. A rank that never answers
makes a ``hang`` verdict, a rank that dies a ``crash`` verdict; either way the
pool is torn down and rebuilt, and the session goes on.
"""
from __future__ import annotations

import json
import multiprocessing.connection as mpc
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .case import Case

START_TIMEOUT = 300.0
# Once one rank has raised, the others are usually stuck in a collective
# waiting for it: give them this long to report, not the whole case timeout.
GRACE_AFTER_ERROR = 1.0


class PoolError(RuntimeError):
    """The pool could not start (bad setup file, backend unavailable, ...)."""


@dataclass
class Result:
    verdict: dict
    seconds: float
    timings: dict = field(default_factory=dict)


class Pool:
    def __init__(
        self,
        size: int,
        device: str = "cpu",
        backend: str | None = None,
        worker_setup: str | None = None,
        case_timeout: float = 120.0,
        log_dir: str | None = None,
    ):
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        self.size = size
        self.case_timeout = case_timeout
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="fuzzshard-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.options = {
            "device": device,
            "backend": backend or ("nccl" if device == "cuda" else "gloo"),
            "mesh_device": device,
            "setup": os.path.abspath(worker_setup) if worker_setup else None,
            "log_dir": self.log_dir,
            # a collective stuck past this raises inside the worker; the driver gives up sooner
            "collective_timeout": max(60.0, 2 * case_timeout),
        }
        self.procs: list = []
        self.conns: list = []
        self.info: dict = {}
        self.restarts = 0
        self._store_dir = None

    # -- lifecycle -------------------------------------------------------
    def start(self) -> Pool:
        # Workers are plain ``python -m fuzzshard.worker`` processes (not
        # multiprocessing spawn, which re-imports the caller's __main__).
        self._store_dir = tempfile.mkdtemp(prefix="fuzzshard-store-")
        authkey = secrets.token_bytes(16)
        listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, "FUZZSHARD_AUTHKEY": authkey.hex(), "OMP_NUM_THREADS": "1"}
        try:
            for rank in range(self.size):
                opts = {**self.options, "rank": rank, "size": self.size, "address": listener.address,
                        "store": os.path.join(self._store_dir, "store")}
                log = open(os.path.join(self.log_dir, f"worker-{rank}.log"), "ab")
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fuzzshard.worker"],
                    env={**env, "FUZZSHARD_WORKER": json.dumps(opts)},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                ))
                log.close()
            self.conns = [None] * self.size
            for _ in range(self.size):
                conn = self._accept(listener)
                _, rank = conn.recv()
                self.conns[rank] = conn
        except (OSError, EOFError, PoolError) as e:
            self.stop()
            raise PoolError(f"workers did not start: {e}\n{self._first_log_tail()}") from None
        finally:
            listener.close()
        deadline = time.monotonic() + START_TIMEOUT
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(deadline - time.monotonic(), 0)):
                self.stop()
                raise PoolError(f"worker {rank} did not start within {START_TIMEOUT:.0f}s: {self._log_tail(rank)}")
            try:
                _, self.info = conn.recv()
            except EOFError:
                tail = self._log_tail(rank)
                self.stop()
                raise PoolError(f"worker {rank} died while starting:\n{tail}") from None
        return self

    def _accept(self, listener):
        """accept(), but give up when a worker exits first or time runs out."""
        sock = listener._listener._socket  # the stdlib exposes no timeout on accept()
        deadline = time.monotonic() + START_TIMEOUT
        while not select.select([sock], [], [], 0.5)[0]:
            if any(p.poll() is not None for p in self.procs):
                raise PoolError("a worker exited before connecting")
            if time.monotonic() > deadline:
                raise PoolError(f"no worker connected within {START_TIMEOUT:.0f}s")
        return listener.accept()

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit",))
            except (OSError, AttributeError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.procs, self.conns = [], []
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)

    def _first_log_tail(self) -> str:
        return next((t for t in (self._log_tail(r) for r in range(self.size)) if t), "")

    def close(self) -> None:
        self.stop()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def restart(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.stop()
        self.restarts += 1
        self.start()

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running ---------------------------------------------------------
    def run(self, case: Case, localize: bool = False) -> Result:
        """Run one case; ``localize`` also records per-module activations to
        name the first diverging module (slower; used after a divergence)."""
        w = case.world_size
        if not 1 <= w <= self.size:
            raise ValueError(f"case needs world size {w}, the pool has {self.size} workers")
        t0 = time.monotonic()
        text = case.to_json()
        for conn in self.conns[:w]:
            conn.send(("case", text, localize))
        answers: dict[int, tuple] = {}
        dead: dict[int, int] = {}
        waiting = {self.conns[r]: r for r in range(w)}
        deadline = t0 + self.case_timeout
        while waiting and not dead:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in mpc.wait(list(waiting), timeout=left):
                r = waiting.pop(conn)
                try:
                    _, verdict, timings = conn.recv()
                    answers[r] = (verdict, timings)
                    if verdict is not None and (verdict.get("oracle") == "error_parity" or verdict["status"] == "invalid"):
                        deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR)
                except (EOFError, OSError):  # the worker's socket closed: it died
                    try:
                        dead[r] = self.procs[r].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        dead[r] = None
        seconds = time.monotonic() - t0
        verdict = self._combine(w, answers, dead, seconds)
        if dead or waiting:
            self.restart()
        timings = answers.get(0, (None, {}))[1]
        return Result(verdict, seconds, timings)

    def _combine(self, w: int, answers: dict, dead: dict, seconds: float) -> dict:
        if dead:
            r = min(dead)
            return {
                "status": "finding",
                "oracle": "crash",
                "dead_ranks": sorted(dead),
                "exitcode": dead[r],
                "error": {"type": _exit_name(dead[r]), "message": f"rank {r} died", "log": self._log_tail(r)},
            }
        verdicts = {r: v for r, (v, _) in answers.items() if v is not None}
        for r in sorted(verdicts):  # any fuzzshard-internal error surfaces as such
            if verdicts[r]["status"] == "error":
                return {**verdicts[r], "rank": r}
        for r in sorted(verdicts):  # the reference raising too makes the case invalid, stuck ranks or not
            if verdicts[r]["status"] == "invalid":
                return verdicts[r]
        for r in sorted(verdicts):  # an exception on some ranks explains the others waiting
            if verdicts[r].get("oracle") == "error_parity":
                out = {**verdicts[r], "rank": r}
                if len(answers) < w:
                    out["stuck_ranks"] = sorted(set(range(w)) - set(answers))
                return out
        if len(answers) < w:
            stuck = sorted(set(range(w)) - set(answers))
            return {
                "status": "finding",
                "oracle": "hang",
                "stuck_ranks": stuck,
                "error": {"type": "Hang", "message": f"ranks {stuck} still running after {seconds:.0f}s"},
            }
        return verdicts.get(0, {"status": "error", "error": "rank 0 returned no verdict"})

    def _log_tail(self, rank: int, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"worker-{rank}.log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


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
