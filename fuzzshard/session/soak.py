"""``fuzzshard soak``: a long fuzz run, split into cells, that a restart resumes.

A soak runs ``--workers`` ranks on this machine. Every epoch it draws a new
layout: the ranks split into *cells* of 1..4 ranks (the first epoch keeps one
cell as large as allowed). Each cell is a process with its own worker pool and
Hypothesis engine (its own seed) that runs cases of every world size it holds;
cells run concurrently. Under torchrun each launched process brings
``--workers`` ranks and rank 0 draws the layout over all of them, so cells
also span processes and nodes (span.py); torchrun's ``--max-restarts``
brings a lost process back, and the run resumes.

Everything shared lives in OUT, written so that a kill at any moment loses
nothing already found and never leaves a half-written file:
  OUT/db/                    the Hypothesis example database of every cell: a
                             failure found anywhere is replayed everywhere first
  OUT/findings/<sig>.json    each finding once, made whole under a temporary name
                             and published with os.link (the first cell wins;
                             the others count it); its .py is published first
                             (life.SoakBook)
  OUT/cells/<cell>.jsonl     one line per case a cell ran (append-only, one
                             writer): what ``fuzzshard report`` counts
  OUT/logs/<cell>/           the cell's progress lines and worker logs
  OUT/scratch/               per-case checkpoint folders, removed after each case
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..findings.life import SoakBook
from ..pool.options import PoolOptions
from ..pool.runner import LostRank, Pool, PoolError
from .engine import Session
from .options import Draws, SessionOptions

STATUS_EVERY = 10.0


@dataclass(frozen=True)
class SoakOptions:
    """What every cell of a soak runs (cli/soak.py makes it of the flags): its draws (targets, world sizes, the
    opt-in families: session/options.py Draws), its pools' options, the plugins each finding records (for
    replay), the shared example database."""
    draws: Draws
    pool: PoolOptions = PoolOptions()
    plugins: tuple[str, ...] = ()
    database: str | None = None  # a redis URL; None: OUT/db

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return self.draws.world_sizes

    def spec(self) -> dict:
        """What a cell's process reads (JSON, run_cell): the draws and the pool's options whole (a new one
        travels without a change here), the pool's case timeout also apart (a member process's, span.py)."""
        return {"draws": self.draws.to_json(), "pool": self.pool.to_json(), "case_timeout": self.pool.case_timeout,
                "plugins": list(self.plugins), "database": self.database}


def layout(workers: int, rnd: random.Random, first: bool, cell_max: int) -> list[int]:
    """Cell sizes for one epoch: a random split of the workers into cells of at
    most ``cell_max`` ranks; the first epoch leads with the largest cell, so
    the largest world size runs from the start."""
    sizes, left = [], workers
    while left:
        biggest = min(left, cell_max)
        size = biggest if first and not sizes else rnd.randint(1, biggest)
        sizes.append(size)
        left -= size
    return sizes


def torchrun_slot() -> dict | None:
    """This process's place in a torchrun launch, or None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    env = os.environ
    return {"rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)),
            "world": int(env.get("WORLD_SIZE", 1)), "node": int(env.get("GROUP_RANK", 0)),
            "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", 0))}


class Soak:
    """The supervisor on one machine (or one torchrun process): epochs of cells."""

    def __init__(self, options: SoakOptions, workers: int, duration: float, epoch: float, out: str, seed: int,
                 cells: list[int] | None = None, progress=None):
        self.options, self.workers, self.duration, self.epoch = options, workers, duration, epoch
        # (sys.stderr when called, not when imported: pytest's capture swaps it, and closes the one it swapped out)
        self.out, self.seed, self.progress = Path(out), seed, progress or sys.stderr
        self.fixed = cells
        self.slot = torchrun_slot()
        self.coord = None  # span.Coordinator under torchrun
        self.stopping = False
        self.cells: list[tuple[str, subprocess.Popen]] = []
        self._read: dict[str, tuple[int, int]] = {}  # cell log -> (bytes read, lines)

    @property
    def me(self) -> int:
        return self.slot["rank"] if self.slot else 0

    def run(self) -> int:
        for d in ("db", "findings", "cells", "logs", "scratch"):
            (self.out / d).mkdir(parents=True, exist_ok=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        if self.slot:
            from ..pool.span import Coordinator

            self.coord = Coordinator(self.me, self.slot["world"])
        end = time.monotonic() + self.duration
        self._t0 = time.monotonic()
        self._started_with = self._count()  # a resumed run's rate counts its own cases
        epoch = self._next_epoch()
        first = epoch == 0
        seen = len(list((self.out / "findings").glob("*.json")))
        print(f"fuzzshard soak: {self.workers} ranks{self._where()} · out {self.out} · "
              f"epoch {epoch}{' (resumed)' if not first else ''} · {seen} findings so far", file=self.progress, flush=True)
        i = 0
        try:
            while not (plan := self._plan(i, epoch, first, end)).get("stop"):
                self.cells = [c for c in (self._spawn(cell, plan["deadline"]) for cell in plan["cells"]) if c]
                started = time.monotonic()
                self._watch()
                if self.coord:
                    self.coord.ready(i)
                if (not self.stopping and self.cells and all(p.returncode for _, p in self.cells)
                        and time.monotonic() - started < 120):
                    print("fuzzshard soak: every cell failed at once; stopping (see the cell logs above)",
                          file=self.progress, flush=True)
                    return 2
                i, epoch, first = i + 1, plan["epoch"] + 1, False
        finally:
            if self.coord and self.me == 0:  # the others follow rank 0 out
                self.coord.publish(i, {"stop": True})
        total = len(list((self.out / "findings").glob("*.json")))
        print(f"fuzzshard soak: done · {total} findings in {self.out / 'findings'} · "
              f"`fuzzshard report {self.out}` for the tables", file=self.progress, flush=True)
        # under torchrun an exit of 1 is a failed worker, which --max-restarts would restart
        return 1 if total and not self.slot else 0

    def _plan(self, i: int, epoch: int, first: bool, end: float) -> dict:
        """Layout i: {"epoch", "deadline", "cells": [{"name", "seed", "slots": [[process, index], ...]}]}
        drawn here, or by torchrun rank 0 over every live process's ranks."""
        if self.coord and self.me != 0:
            return self.coord.follow(i, lambda: self.stopping)
        if self.stopping or time.monotonic() >= end - 5:
            return {"stop": True}
        procs = self.coord.live(i, lambda: self.stopping) if self.coord else [0]
        slots = [[p, j] for p in procs for j in range(self.workers)]
        rnd = random.Random(f"{self.seed}/{epoch}")
        sizes = (self.fixed if self.fixed and sum(self.fixed) == len(slots)
                 else layout(len(slots), rnd, first, max(self.options.world_sizes)))
        cells, k = [], 0
        for j, size in enumerate(sizes):
            cells.append({"name": f"e{epoch}c{j}", "seed": rnd.randrange(2**31), "slots": slots[k:k + size]})
            k += size
        plan = {"epoch": epoch, "deadline": time.time() + min(self.epoch, end - time.monotonic()), "cells": cells}
        if self.coord:
            self.coord.publish(i, plan)
        return plan

    def _where(self) -> str:
        s = self.slot
        return f" · torchrun rank {s['rank']}/{s['world']} on {socket.gethostname()}" if s else ""

    def _next_epoch(self) -> int:
        """Epochs continue after a restart, so a resumed soak draws new seeds."""
        done = [int(m.group(1)) for p in (self.out / "cells").iterdir() if (m := re.fullmatch(r"e(\d+)c\d+\.jsonl", p.name))]
        return max(done) + 1 if done else 0

    def _spawn(self, cell: dict, deadline: float) -> tuple[str, subprocess.Popen] | None:
        """This process's part of ``cell``: the cell itself if it holds the
        cell's first rank, else a member process that starts its ranks."""
        slots, name = cell["slots"], cell["name"]
        mine = [k for k, (p, _) in enumerate(slots) if p == self.me]
        if not mine:
            return None
        # GPUs: each torchrun process on a node takes its own block of --workers devices
        first_gpu = self.slot["local_rank"] * self.workers if self.slot else 0
        procs = sorted({p for p, _ in slots})
        if slots[0][0] == self.me:
            spec = {**self.options.spec(), "name": name, "size": len(slots), "seed": cell["seed"], "deadline": deadline,
                    "out": str(self.out), "device_offset": first_gpu + slots[0][1], "procs": len(procs),
                    "origin": {"host": socket.gethostname(), **(self.slot or {})}}
            if len(procs) > 1:
                spec["span"] = {"store": self.coord.where, "local": len(mine), "members": procs[1:]}
            module, log = "fuzzshard.session.soak", "cell.log"
        else:
            spec = {"name": name, "ranks": mine, "gpus": {str(k): first_gpu + slots[k][1] for k in mine},
                    "leader": slots[0][0], "out": str(self.out), "store": self.coord.where, "deadline": deadline,
                    "case_timeout": self.options.pool.case_timeout}
            module, log = "fuzzshard.pool.span", f"member-r{self.me}.log"
        log_dir = self.out / "logs" / name
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / log, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)],
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # Ctrl-C reaches the supervisor, which stops cells in order
        return name, proc

    def _watch(self) -> None:
        last = time.monotonic()
        while any(p.poll() is None for _, p in self.cells):
            time.sleep(0.5)
            if self.coord:
                self.coord.beat()
            if time.monotonic() - last >= STATUS_EVERY:
                last = time.monotonic()
                if not self.slot or self.slot["local_rank"] == 0:  # one status line per node
                    print(self.status_line(), file=self.progress, flush=True)
        for name, p in self.cells:
            if p.returncode:
                print(f"fuzzshard soak: cell {name} exited with {p.returncode}; see {self.out / 'logs' / name}",
                      file=self.progress, flush=True)

    def _count(self) -> int:
        """Cases logged so far by every cell of the run, read incrementally."""
        for p in (self.out / "cells").glob("e*.jsonl"):
            offset, n = self._read.get(p.name, (0, 0))
            with open(p, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            whole = chunk[:chunk.rfind(b"\n") + 1]  # a line being written is counted next time
            self._read[p.name] = (offset + len(whole), n + whole.count(b"\n"))
        return sum(n for _, n in self._read.values())

    def status_line(self) -> str:
        cases = self._count()
        rate = (cases - self._started_with) / max(time.monotonic() - self._t0, 1e-9)
        alive = sum(1 for _, p in self.cells if p.poll() is None)
        found = len(list((self.out / "findings").glob("*.json")))
        from .engine import _clock

        elapsed = time.monotonic() - self._t0
        return (f"[fuzzshard soak{self._where()}] {cases} cases · {rate:.2f} cases/s · "
                f"{alive} cells running · {found} findings · {_clock(elapsed)} of {_clock(self.duration)}")

    def _stop(self, signum, frame) -> None:
        """SIGTERM (SLURM preemption) or Ctrl-C: each cell finishes its case,
        publishes what it found and exits; a second signal kills them."""
        if self.stopping:
            for _, p in self.cells:
                if p.poll() is None:
                    p.kill()
            return
        self.stopping = True
        print(f"fuzzshard soak: {signal.Signals(signum).name}: stopping cells (resume with the same --out)",
              file=self.progress, flush=True)
        for _, p in self.cells:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)


# -- one cell ------------------------------------------------------------------
class SoakSession(Session):
    """One cell's fuzz session: its findings published into OUT/findings/, shared by every cell
    (life.SoakBook: the first cell wins, ``origin`` says which cell wrote it), its examples in OUT/db,
    a line per case in OUT/cells/NAME.jsonl. ``spec``: the cell as the supervisor wrote it (Soak._spawn)."""

    fallback_db = "db"

    def __init__(self, spec: dict, pool, **kwargs):
        out = Path(spec["out"])
        origin = {**spec["origin"], "cell": spec["name"], "ranks": spec["size"], "seed": spec["seed"]}
        draws = Draws(**spec["draws"])
        draws = draws.replace(world_sizes=[w for w in draws.world_sizes if w <= spec["size"]] or [1])
        options = SessionOptions(out=str(out), duration=max(1.0, spec["deadline"] - time.time()), seed=spec["seed"],
                                 database=spec["database"] or str(out / "db"), plugins=spec.get("plugins") or (),
                                 findings_dir=str(out / "findings"))
        super().__init__(pool, draws, options, book_class=functools.partial(SoakBook, origin=origin), **kwargs)
        self.procs = spec.get("procs", 1)  # the processes its ranks run in (a cell spanning torchrun processes)
        self.log = out / "cells" / f"{spec['name']}.jsonl"
        self.log.touch()
        self.book.catch_up()  # what other cells published before this one started: known here


def run_cell(spec: dict) -> int:
    """One cell, in its own process (``python -m fuzzshard.session.soak SPEC``): its pool, its session."""
    out = Path(spec["out"])
    from ..pool.worker import run_setup_file

    options = PoolOptions(**spec["pool"])
    for path in options.setup:  # here too: a plugin's optimizer is drawn in this process
        run_setup_file(path)
    link = None
    if "span" in spec:  # ranks on other torchrun processes too
        from ..pool.span import Link

        link = Link(spec["span"]["store"], spec["name"], spec["span"]["local"], spec["span"].get("members", []))
    pool = Pool(spec["size"], options=options, log_dir=str(out / "logs" / spec["name"]), spare=True,
                device_offset=spec.get("device_offset", 0), link=link, scratch=str(out / "scratch"))
    try:
        pool.start()
    except PoolError as e:
        print(f"cell {spec['name']}: workers did not start: {e}", flush=True)
        pool.close()
        return 3
    session = SoakSession(spec, pool, progress=sys.stdout)

    def stop(signum, frame):
        session.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        session.run()
    except LostRank as e:  # its other process or node went away: the cell ends, nothing to report
        print(f"cell {spec['name']}: {e}; cell closed", flush=True)
        return 4
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_cell(json.loads(sys.argv[1])))
