"""The soak: cells that share one example database and one findings folder,
a clean stop on SIGTERM that a restart resumes, torchrun across two
simulated nodes, and the report."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import PLANTED, run_cli

# (--loop none: what these soaks find was picked against the draws without the training loop, as run_cli's)
PLANTED_ARGS = ["--target", "dtensor", "--optimizers", "SGD", "--world-sizes", "1", "--checkpoints", "none",
                "--loop", "none", "--worker-setup", str(PLANTED / "skip_weight_decay.py")]


def _soak(out, *args):
    return [sys.executable, "-m", "fuzzshard", "soak", "--out", str(out), *PLANTED_ARGS, *map(str, args)]


def _cases(out) -> dict:
    """{cell: [case lines]} from the cells' logs."""
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in (out / "cells").glob("*.jsonl")}


def _findings(out) -> dict:
    return {p.name: p.read_bytes() for p in (out / "findings").iterdir()}


def test_cells_share_findings_and_sigterm_then_restart_resumes(tmp_path):
    out = tmp_path / "run"
    # two cells of one rank each find the same planted bug; each signature is written once
    soak = subprocess.Popen(_soak(out, "--cells", "1,1", "--duration", "10m"), stderr=subprocess.PIPE, text=True)
    def both_cells_hit_a_published_finding() -> bool:
        """(each cell's log has a case with a signature, and the finding's file is written)"""
        try:
            cells = _cases(out)
        except (OSError, ValueError):  # a log line being written
            return False
        return (len(cells) == 2 and all(any(c["sig"] for c in lines) for lines in cells.values())
                and any((out / "findings").glob("*.json")))

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not both_cells_hit_a_published_finding():
        time.sleep(1)
    time.sleep(3)
    soak.send_signal(signal.SIGTERM)  # as SLURM preempts a job
    _, err = soak.communicate(timeout=120)
    assert soak.returncode == 1, err[-3000:]
    assert "SIGTERM: stopping cells" in err
    found = _findings(out)
    sigs = sorted(n[:-5] for n in found if n.endswith(".json"))
    assert sigs and all(s.startswith("dtensor.parity.SGD.") for s in sigs), sigs
    assert sorted(found) == sorted([s + ".json" for s in sigs] + [s + ".py" for s in sigs])  # no temp files left
    before = _cases(out)
    assert len(before) == 2
    hits = {cell: {c["sig"] for c in lines if c["sig"]} for cell, lines in before.items()}
    assert all(set(sigs) & h for h in hits.values()), hits  # both cells hit the bug; nobody wrote it twice
    origin = json.loads(found[sigs[0] + ".json"])["environment"]["origin"]
    assert origin["cell"] in before and origin["host"] == socket.gethostname()

    # the same command resumes: new cells with new seeds, earlier counts and findings kept as they were
    r = subprocess.run(_soak(out, "--cells", "1", "--duration", "40s"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and "(resumed)" in r.stderr, r.stderr[-3000:]
    after = _cases(out)
    assert all(after[cell] == lines for cell, lines in before.items())
    assert len(after) == 3 and sum(map(len, after.values())) > sum(map(len, before.values()))
    assert _findings(out) == found
    # a resumed cell counts the published bugs as known: no second shrink, no second file
    new_cell = next(c for c in after if c not in before)
    assert all(c["known"] for c in after[new_cell] if c["sig"] in sigs)

    rep = run_cli("report", out)
    assert rep.returncode == 0, rep.stderr
    assert "world size" in rep.stdout and "optimizer" in rep.stdout and sigs[0] in rep.stdout
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 3 and sigs[0] in page


def _node(pid: int) -> list[int]:
    """A process and every process under it (read from /proc): one simulated node."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _wait_for(what, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__}"
        time.sleep(0.5)


def test_torchrun_soak_cells_span_nodes_and_a_lost_node_leaves_the_rest_going(tmp_path):
    """Two torchrun agents (simulated nodes) with 2 ranks each meet through c10d
    rendezvous. ``--cells 1,2,1``: the middle cell spans both nodes. Mid-run
    one node dies whole (SIGKILL to its agent and everything under it): the
    other node's cells go on, later layouts leave the lost node out, and the
    findings folder holds only whole files."""
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FUZZSHARD", "TORCHELASTIC"))}
    args = [a if a != "1" else "1,2" for a in PLANTED_ARGS]  # --world-sizes 1,2
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    agents = []
    for log in logs:
        with open(log, "w") as f:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "soaktest",
                 "-m", "fuzzshard", "soak", "--workers", "2", "--cells", "1,2,1", "--epoch", "45s", "--duration", "70s",
                 "--loop", "none", "--out", str(out), *args], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(2)  # the first agent hosts the rendezvous store
    # the node dies once the spanning cell has run a 2-rank case; a 45 s epoch keeps that well inside
    # epoch 0 on a loaded machine (with 30 s, one CI run saw the cell end without being lost)
    try:
        def spanning_cell_ran_a_two_rank_case():
            p = out / "cells" / "e0c1.jsonl"
            return p.exists() and any(json.loads(x)["world"] == 2 for x in p.read_text().splitlines())
        _wait_for(spanning_cell_ran_a_two_rank_case, 240)
        lost = next(n for n, log in enumerate(logs) if "torchrun rank 1/2" in log.read_text())
        for pid in _node(agents[lost].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        survivor = logs[1 - lost]

        def survivor_done():
            return "fuzzshard soak: done" in survivor.read_text()
        _wait_for(survivor_done, 240)
    finally:
        for a in agents:
            try:
                os.killpg(a.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            a.wait(timeout=60)
    text = survivor.read_text()
    assert "torchrun rank 1 is silent; later cells leave it out" in text, text[-3000:]
    cells = _cases(out)
    spanning = cells["e0c1"]
    assert {c["procs"] for c in spanning} == {2} and {1, 2} <= {c["world"] for c in spanning}
    # lost mid-case (no exit code came back) or while a new generation started (a fresh confirmation)
    cell_log = (out / "logs" / "e0c1" / "cell.log").read_text()
    assert re.search(r"lost with (its|their) process .*; cell closed", cell_log), cell_log[-2000:] + text[-2000:]
    assert "cell e0c1 exited with 4" in text  # a lost rank ends its cell, and is no finding
    later = [c for c in cells if not c.startswith("e0")]
    assert later and all(c["procs"] == 1 for name in later for c in cells[name]), later  # the survivor's ranks only
    found = _findings(out)
    sigs = sorted(n[:-5] for n in found if n.endswith(".json"))
    assert any(s.startswith("dtensor.parity.SGD.") for s in sigs), sigs  # (a new torch finding at W2 may join it)
    assert sorted(found) == sorted([s + ".json" for s in sigs] + [s + ".py" for s in sigs])  # whole files only
    for s in sigs:
        assert json.loads(found[s + ".json"])["signature"] == s


def test_a_cells_session_says_what_it_changes_through_the_sessions_hooks(tmp_path):
    """A cell's session (session/soak.py's module-level SoakSession) changes what a Session does only through
    its public hooks: ``book_class`` (a SoakBook with the cell's origin), ``fallback_db``, ``log``, ``procs``;
    no override of a private method. Built without a pool: nothing runs."""
    import io

    from fuzzshard.findings.life import SoakBook
    from fuzzshard.session.soak import SoakSession

    (tmp_path / "cells").mkdir()
    spec = {"out": str(tmp_path), "origin": {"host": "h"}, "name": "e0c1", "size": 2, "seed": 5, "procs": 2,
            "draws": {"world_sizes": [1, 2, 3], "targets": ["dtensor"]}, "deadline": time.time() + 60,
            "database": None, "plugins": []}
    s = SoakSession(spec, None, progress=io.StringIO(), known={})
    assert type(s.book) is SoakBook and s.book.origin == {"host": "h", "cell": "e0c1", "ranks": 2, "seed": 5}
    assert s.book.findings_dir == tmp_path / "findings" and s.world_sizes == [1, 2] and s.seed == 5
    assert s.fallback_db == "db" and s.database == str(tmp_path / "db") and s.procs == 2
    assert s.log == tmp_path / "cells" / "e0c1.jsonl" and s.log.exists()
    assert not any(n.startswith("_") and not n.startswith("__") for n in vars(SoakSession))
