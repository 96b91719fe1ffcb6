"""The soak: cells that share one example database and one findings folder,
a clean stop on SIGTERM that a restart resumes, torchrun across two
simulated nodes, and the report."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import PLANTED, run_cli

PLANTED_ARGS = ["--targets", "dtensor", "--optimizers", "SGD", "--world-sizes", "1", "--checkpoints", "none",
                "--worker-setup", str(PLANTED / "skip_weight_decay.py")]


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
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list((out / "findings").glob("*.json"))) < 2:
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
    r = subprocess.run(_soak(out, "--cells", "1", "--duration", "20s"), capture_output=True, text=True, timeout=240)
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
    assert page.count("<svg") == 2 and sigs[0] in page


def test_soak_under_torchrun_on_two_simulated_nodes(tmp_path):
    """Two torchrun agents, 2 processes each, meet through c10d rendezvous;
    every process soaks its own cell and all four share --out."""
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FUZZSHARD", "TORCHELASTIC"))}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "soaktest",
         "-m", "fuzzshard", "soak", "--workers", "1", "--duration", "35s", "--out", str(out), *PLANTED_ARGS],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-2000:] for log in logs)
    cells = _cases(out)
    assert sorted(cells) == ["r0-e0c0", "r1-e0c0", "r2-e0c0", "r3-e0c0"]
    found = _findings(out)
    sigs = sorted(n[:-5] for n in found if n.endswith(".json"))
    assert sigs and all(s.startswith("dtensor.parity.SGD.") for s in sigs)
    assert len(found) == 2 * len(sigs)  # one .json and one .py per signature, nothing else
    hit_by = {c for c, lines in cells.items() if any(x["sig"] in sigs for x in lines)}
    assert len(hit_by) >= 2, hit_by
    nodes = {json.loads(found[s + ".json"])["environment"]["origin"]["node"] for s in sigs}
    assert nodes <= {0, 1}
