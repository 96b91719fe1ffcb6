"""Worker processes forked from a process that has already imported torch.

A worker spent about 3 s of CPU importing torch and the kernel before it
could join its process group, once per rank and per generation: on a small
machine a fresh generation of 4 ranks (a pool restart after a crash, a
fresh confirmation, a spare set) took seconds of the cases' CPU. The zygote
imports once, then forks each worker: a worker starts in milliseconds.

Fresh stays fresh: the zygote never runs a case, opens no process group and
never touches CUDA (importing torch does not initialize it), so a forked
worker holds nothing but imported modules. Setup files (--plugin,
--worker-setup) run in each worker after the fork, as before.

One zygote per driver process, started on the first spawn. It dies with the
driver (PR_SET_PDEATHSIG, and EOF on its socket), and its workers die with it.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection


def warm_modules() -> list[str]:
    """What a worker imports for its cases, read off the code rather than kept by hand, so a new
    target or kernel module is never forgotten: the worker, every module of fuzzshard.kernel (the
    targets with it), and every torch module those name, at their top or inside a function (a lazily
    imported one, DCP or ZeroRedundancyOptimizer, is then imported once here, not in every worker)."""
    import ast
    import pkgutil

    from .. import kernel

    ours = ["fuzzshard.pool.worker", "fuzzshard.case"]
    ours += [m.name for m in pkgutil.walk_packages(kernel.__path__, "fuzzshard.kernel.")]
    named: set[str] = set()
    for name in ours:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.Import):
                    named.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    named.add(node.module)
    return sorted(m for m in named if m == "torch" or m.startswith("torch.")) + ours


class Zygote:
    """The driver's side: ``spawn(env, log_path)`` returns a Popen-like handle."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fuzzshard.pool.zygote", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}

    def spawn(self, env: dict, log_path: str) -> Forked:
        with self.lock:
            self.conn.send(("spawn", env, log_path))
            while True:
                msg = self.conn.recv()
                if msg[0] == "spawned":
                    return Forked(self, msg[1])
                self._note(msg)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of a worker, None while it runs (-N: killed by signal N)."""
        with self.lock:
            try:
                while pid not in self.exits and self.conn.poll(0):
                    self._note(self.conn.recv())
            except (EOFError, OSError):  # the zygote is gone (a signal to the whole process group): its workers too
                self.exits.setdefault(pid, -signal.SIGTERM)
            return self.exits.get(pid)

    def _note(self, msg) -> None:
        if msg[0] == "exited":
            self.exits[msg[1]] = msg[2]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Forked:
    """A worker the zygote forked: what runner needs of ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
            if self.returncode is None and not self.zygote.alive():
                self.returncode = -signal.SIGKILL  # the zygote went, and its workers with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started (again, if it died) on first use."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = Zygote()
        return _zygote


def prestart() -> None:
    """Start this process's zygote now, before the driver imports torch itself: its imports (torch, the kernel,
    the targets: ~4 s of CPU) then run beside the driver's (~2 s) instead of after them, and a `fuzzshard replay`
    or `fuzz` has its first workers ~2 s sooner where a core is free. The CLI calls it once it has read its
    arguments (a zygote started for a command that is then refused dies with the driver)."""
    zygote()


# -- the zygote process --------------------------------------------------------
def main(fd: int) -> None:
    import select

    # the driver decides what a Ctrl-C or a SIGTERM to the whole group means (the zygote's workers die with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from .worker import _die_with_parent, _name

    _die_with_parent()
    _name("fuzzshard-zygote")
    for name in warm_modules():
        try:
            importlib.import_module(name)
        except ImportError:  # a module another torch release has (versions.py chooses): the worker will not need it
            pass
    from .. import targets

    for name in targets.names():  # each target's module and what it imports
        targets.get(name)
    conn = Connection(fd)
    children: set[int] = set()
    while True:
        if select.select([conn], [], [], 0.05)[0]:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the driver is gone: so are we, and our workers with us
                return
            pid = _fork(conn, *msg[1:])
            children.add(pid)
            conn.send(("spawned", pid))
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


def _fork(conn: Connection, env: dict, log_path: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        conn.close()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from .worker import main as worker_main

        worker_main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    from .worker import _exit_now

    _exit_now(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
