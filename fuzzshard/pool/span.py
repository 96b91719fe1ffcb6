"""Soak cells that span torchrun processes, and so nodes.

Under torchrun, global rank 0 draws every epoch's layout over the ranks of all
processes (``--workers`` each, in rank order, so a cell crossing a process
boundary also crosses nodes when the processes sit on different nodes). The
processes meet in torchrun's own TCPStore (MASTER_ADDR:MASTER_PORT), under a
prefix per launch and restart:

  epoch/<i>                  layout i, set by rank 0: {"epoch", "deadline", "cells"}, or {"stop": true}
  ready/<i>/<rank>           process <rank> finished its cells of layout i
  beat/<rank>                a counter each process bumps every BEAT s; rank 0 leaves
                             a process whose counter stopped out of later layouts
  cell/<name>/gen            the leader's newest worker generation (options, authkey)
  cell/<name>/g<k>/exit/<r>  how remote rank r of generation k ended, when it died
  cell/<name>/done           the leader closed its pool

A cell's leader (the process holding its first rank) runs the engine and the
pool as any cell does; its pool spawns the leader's own ranks and announces
each generation. On every other process of the cell a member process starts
its ranks of each announced generation and kills those of the one before: a
hang or a crash rebuilds the whole cell, the rest of the run untouched. A
remote rank whose socket closes with no exit code reported was lost with its
process or node: runner.LostRank ends that cell, never a finding.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .store import open_store

BEAT = 2.0
STALE = 15.0  # a process whose beat counter has not moved for this long is gone
POLL = 0.2


def torchrun_store(timeout: float = 120.0):
    """(store, where): a client of torchrun's TCPStore under this launch's
    prefix, and what a worker needs to open the same store."""
    env = os.environ
    rank = int(env.get("RANK", 0))
    prefix = f"fuzzshard-soak/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    where = {"host": env["MASTER_ADDR"], "port": int(env["MASTER_PORT"]), "prefix": prefix}
    # torchrun's agent hosts the store (the default); otherwise rank 0 does, as init_process_group would
    hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    return open_store(where, timeout, is_master=hosts), where


def reachable_ip(where: dict) -> str:
    """This machine's address on the route to the store: where other nodes reach it."""
    with socket.create_connection((where["host"], where["port"]), timeout=30) as s:
        return s.getsockname()[0]


class Link:
    """The leader's side of a spanning cell, handed to runner.Pool."""

    def __init__(self, where: dict, name: str, local: int, members=()):
        self.store, self.where = open_store(where), where
        self.key, self.local, self.host = f"cell/{name}/", local, reachable_ip(where)
        self.members, self.beats = list(members), Beats(self.store)  # the torchrun processes holding our other ranks

    def lost(self) -> bool:
        """Whether a member process has fallen silent (its node is gone): then
        no rank of a new generation will ever come from it."""
        return any(self.beats.silent(p) for p in self.members)

    def worker_store(self, gen: int) -> dict:
        return {**self.where, "prefix": f"{self.where['prefix']}{self.key}g{gen}/pg/"}

    def announce(self, gen: int, options: dict, authkey: str) -> None:
        self.store.set(self.key + "gen", json.dumps({"index": gen, "options": options, "authkey": authkey}))

    def exit_code(self, gen: int, rank: int, wait: float = 5.0) -> int | None:
        key = f"{self.key}g{gen}/exit/{rank}"
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self.store.check([key]):
                return int(self.store.get(key))
            time.sleep(POLL)
        return None

    def close(self) -> None:
        try:
            self.store.set(self.key + "done", "1")
        except Exception:  # the store went with the launch: members stop on their own
            pass


def run_member(spec: dict) -> int:
    """A process's ranks in a cell another process leads: started anew for
    every generation the leader announces, until it says done or its process
    falls silent."""
    from .runner import START_TIMEOUT, spawn_worker

    store = open_store(spec["store"])
    key, name = f"cell/{spec['name']}/", spec["name"]
    log_dir = Path(spec["out"]) / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM: the leader finishes its case and says done; killing ranks now would fail that case
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    give_up = spec["deadline"] + 3 * spec["case_timeout"] + START_TIMEOUT
    gen, procs, told = 0, {}, set()
    beats = Beats(store)
    while time.time() < give_up and not store.check([key + "done"]) and not beats.silent(spec["leader"]):
        if store.check([key + "gen"]):
            g = json.loads(store.get(key + "gen"))
            if g["index"] != gen:
                _kill(procs.values())
                gen, told = g["index"], set()
                procs = {r: spawn_worker({**g["options"], "device_offset": spec["gpus"][str(r)] - r}, r, g["authkey"],
                                         str(log_dir / f"gen{gen}-rank{r}.log")) for r in spec["ranks"]}
                print(f"cell {name}: generation {gen}: ranks {spec['ranks']} started", flush=True)
        for r, p in procs.items():
            if r not in told and p.poll() not in (None, 0):  # died on its own: the leader reports a crash
                store.set(f"{key}g{gen}/exit/{r}", str(p.returncode))
                told.add(r)
        time.sleep(POLL)
    end = time.monotonic() + 10  # told "exit" by the leader, the ranks are on their way out
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < end:
        time.sleep(POLL)
    _kill(procs.values())
    return 0


class Beats:
    """Watches other processes' beat counters (counters, not clocks: nodes' clocks differ)."""

    def __init__(self, store):
        self.store = store
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)

    def silent(self, rank: int) -> bool:
        n = self.store.add(f"beat/{rank}", 0)
        last = self._seen.get(rank)
        if last is None or last[0] != n:
            self._seen[rank] = (n, time.monotonic())
            return False
        return time.monotonic() - last[1] > STALE


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


class Coordinator:
    """Every process's view of the launch: global rank 0 publishes layouts, the
    others follow them; all report when their cells of a layout are done."""

    def __init__(self, rank: int, world: int):
        self.store, self.where = torchrun_store()
        self.rank, self.world = rank, world
        self.beats = Beats(self.store)
        self._last_beat = 0.0
        self.lost: set[int] = set()
        self.beat()

    def beat(self) -> None:
        if time.monotonic() - self._last_beat >= BEAT:
            self._last_beat = time.monotonic()
            self.store.add(f"beat/{self.rank}", 1)

    def live(self, i: int, stopping) -> list[int]:
        """Rank 0, before layout i: the processes that finished layout i-1,
        waiting for each until it does or falls silent."""
        if i == 0:
            return list(range(self.world))
        waiting = [r for r in range(1, self.world) if r not in self.lost]
        while waiting and not stopping():
            self.beat()
            for r in list(waiting):
                if self.store.check([f"ready/{i - 1}/{r}"]):
                    waiting.remove(r)
                elif self.beats.silent(r):
                    print(f"fuzzshard soak: torchrun rank {r} is silent; later cells leave it out",
                          file=sys.stderr, flush=True)
                    self.lost.add(r)
                    waiting.remove(r)
            time.sleep(POLL)
        return [r for r in range(self.world) if r not in self.lost]

    def publish(self, i: int, record: dict) -> None:
        self.store.set(f"epoch/{i}", json.dumps(record))

    def follow(self, i: int, stopping) -> dict:
        """Layout i as rank 0 publishes it; {"stop": True} if rank 0 falls silent."""
        while not self.store.check([f"epoch/{i}"]):
            self.beat()
            if stopping() or self.beats.silent(0):
                return {"stop": True}
            time.sleep(POLL)
        return json.loads(self.store.get(f"epoch/{i}"))

    def ready(self, i: int) -> None:
        self.store.set(f"ready/{i}/{self.rank}", "1")


if __name__ == "__main__":
    sys.exit(run_member(json.loads(sys.argv[1])))
