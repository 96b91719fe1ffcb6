"""The example database shared through redis, against a real redis-server on
loopback: every write also lands in the directory database, and a server that
goes away mid-run costs one line of output, never a run or a finding."""
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from conftest import PLANTED, run_cli
from fuzzshard.session.database import open_database

PREFIX = b"hypothesis-example:"  # RedisExampleDatabase's key prefix
PLANTED_ARGS = ["--optimizers", "SGD", "--world-sizes", "1", "--checkpoints", "none", "--case-timeout", "60",
                "--loop", "none", "--worker-setup", str(PLANTED / "skip_weight_decay.py")]


class Server:
    """A redis-server of this test's own: loopback, a free port, no persistence."""

    def __init__(self, tmp):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        (tmp / "redis").mkdir()
        self.log = tmp / "redis.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                 "--dir", str(tmp / "redis"), "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.05)
        self.client = client

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (CI's .ci/run installs Debian's redis-server)")
    s = Server(tmp_path)
    yield s
    s.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the database itself ---------------------------------------------------------
def test_every_write_reaches_redis_and_the_directory(server, tmp_path):
    said = io.StringIO()
    db = open_database(server.url, str(tmp_path / "db"), said)
    assert isinstance(db, ExampleDatabase)
    directory = DirectoryBasedExampleDatabase(tmp_path / "db")
    db.save(b"k", b"v1")
    db.save(b"k", b"v2")
    db.save(b"k", b"v2")
    assert sorted(db.fetch(b"k")) == [b"v1", b"v2"]
    assert server.client.smembers(PREFIX + b"k") == {b"v1", b"v2"}
    assert sorted(directory.fetch(b"k")) == [b"v1", b"v2"]

    db.delete(b"k", b"v1")
    db.move(b"k", b"k.secondary", b"v2")
    for where in (lambda key: server.client.smembers(PREFIX + key), lambda key: set(directory.fetch(key))):
        assert where(b"k") == set() and where(b"k.secondary") == {b"v2"}

    # reads come from redis: what another run saved there is replayed here
    server.client.sadd(PREFIX + b"k", b"from another run")
    assert list(db.fetch(b"k")) == [b"from another run"]
    assert said.getvalue() == ""
    # a directory is a plain directory database
    assert isinstance(open_database(str(tmp_path / "plain"), str(tmp_path / "unused"), said), DirectoryBasedExampleDatabase)


def test_a_server_that_goes_away_leaves_the_directory_with_everything(server, tmp_path):
    said = io.StringIO()
    db = open_database(server.url, str(tmp_path / "db"), said)
    db.save(b"k", b"before")
    db.save(b"k", b"gone later")
    server.kill()
    assert sorted(db.fetch(b"k")) == [b"before", b"gone later"]  # no exception: the directory answers
    db.save(b"k", b"after")
    db.delete(b"k", b"gone later")
    db.move(b"k", b"other", b"before")
    lines = said.getvalue().splitlines()
    assert len(lines) == 1, lines  # one line, not one per call
    assert f"redis at {server.url} went away (ConnectionError" in lines[0] and str(tmp_path / "db") in lines[0]
    directory = DirectoryBasedExampleDatabase(tmp_path / "db")
    assert sorted(directory.fetch(b"k")) == [b"after"]
    assert sorted(directory.fetch(b"other")) == [b"before"]
    assert sorted(db.fetch(b"k")) == [b"after"]


def test_redis_unreachable_at_open_uses_the_directory(tmp_path):
    said = io.StringIO()
    url = f"redis://127.0.0.1:{_free_port()}/0"
    t0 = time.monotonic()
    db = open_database(url, str(tmp_path / "db"), said)
    db.save(b"k", b"v")
    assert sorted(db.fetch(b"k")) == [b"v"]
    assert time.monotonic() - t0 < 10
    lines = said.getvalue().splitlines()
    assert len(lines) == 1 and f"redis at {url} cannot be reached" in lines[0] and str(tmp_path / "db") in lines[0]
    assert sorted(DirectoryBasedExampleDatabase(tmp_path / "db").fetch(b"k")) == [b"v"]


# -- through the command line ------------------------------------------------------
def _cases(out) -> list[dict]:
    lines = [json.loads(line) for p in sorted((out / "cells").glob("*.jsonl")) for line in p.read_text().splitlines()]
    return sorted(lines, key=lambda c: c["t"])


def _soak(out, url, *args):
    return subprocess.Popen([sys.executable, "-m", "fuzzshard", "soak", "--out", str(out), "--redis", url,
                             "--target", "dtensor", "--workers", "1", "--epoch", "10m", *PLANTED_ARGS, *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(what, timeout: float, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    return what()


def _end(proc) -> str:
    """SIGTERM (the soak stops its cells after their case) and the soak's stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def test_a_second_run_replays_the_first_runs_failure_from_redis(server, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    r = run_cli("fuzz", "--target", "dtensor", "--max-examples", 25, "--seed", 0, "--out", first,
                "--redis", server.url, *PLANTED_ARGS, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    sigs = {p.stem for p in first.glob("*.json")}
    assert sigs and all(s.startswith("dtensor.parity.SGD.") for s in sigs), sigs
    # the failing examples are in redis, and the same ones in the run's directory database
    keys = [k for k in server.client.keys(PREFIX + b"*") if not k.endswith((b".secondary", b".pareto"))]
    assert keys, server.client.keys()
    directory = DirectoryBasedExampleDatabase(first / ".hypothesis")
    for k in keys:
        assert server.client.smembers(k) == set(directory.fetch(k[len(PREFIX):]))
    assert sum(server.client.scard(k) for k in keys) >= len(sigs)

    # a soak elsewhere (a fresh --out, another seed) replays them before drawing anything
    # the same bugs: a finding is named by whichever face of its bug was confirmed first (generalize.py)
    soak = _soak(second, server.url, "--seed", 1, "--duration", "2m")
    try:
        found = _wait_for(lambda: sigs <= _names(second / "findings"), 150, soak)
    finally:
        err = _end(soak)
    assert found, err[-3000:]
    cases = _cases(second)
    faces = _names(first)
    assert cases[0]["sig"] in faces, cases[:5]
    assert {c["sig"] for c in cases[:len(sigs)]} <= faces, cases[:5]


def _names(folder) -> set[str]:
    """Every signature the findings in ``folder`` are known by: each one's own and its faces."""
    out = set()
    for p in folder.glob("*.json"):
        f = json.loads(p.read_text())
        out |= {f["signature"], *f.get("faces", [])}
    return out


def test_a_soak_goes_on_when_redis_goes_away(server, tmp_path):
    out = tmp_path / "run"
    soak = _soak(out, server.url, "--seed", 0, "--duration", "3m")
    killed, found = None, []
    try:
        if _wait_for(lambda: (out / "cells").is_dir() and _cases(out), 120, soak):
            killed = time.time()
            server.kill()  # the cell's database is open and has answered; now it is gone
            found = _wait_for(lambda: list((out / "findings").glob("dtensor.parity.SGD.*.json")), 150, soak)
            # and it keeps running cases (a steered soak may reach the bug within a few)
            _wait_for(lambda: sum(c["t"] > killed for c in _cases(out)) >= 10, 120, soak)
    finally:
        err = _end(soak)
    assert killed is not None, f"no case logged: {err[-3000:]}"
    assert soak.returncode == 1 and found, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    log = "".join(p.read_text() for p in (out / "logs").glob("*/cell.log"))
    went = [line for line in log.splitlines() if "went away" in line]
    assert len(went) == 1, log[-3000:]
    assert went[0].startswith(f"fuzzshard: redis at {server.url} went away") and str(out / "db") in went[0]
    assert "cannot be reached" not in log and "Traceback" not in log, log[-3000:]
    # the bug was first hit with redis gone, and the soak kept running cases
    cases = _cases(out)
    sig = found[0].stem
    assert min(c["t"] for c in cases if c["sig"] == sig) > killed, cases[:30]
    assert sum(c["t"] > killed for c in cases) >= 10
