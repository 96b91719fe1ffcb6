"""Findings a user can trust, and never loses: a new finding is re-run in
fresh workers before it is reported (a planted contamination is called so,
never a finding); its files are written the moment it is seen and survive
SIGINT, SIGTERM and SIGKILL; --duration bounds the session, shrinking
included; a shrinking hang runs under a derived timeout; replay exits 1 only
for the recorded signature, on the device the case was recorded on."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PLANTED, run_cli

BUG = ["--target", "dtensor", "--world-sizes", "1,2", "--seed", "0", "--optimizers", "SGD,AdamW",
       "--checkpoints", "none"]


def _start(out: Path, *args, setup: str | None = None) -> tuple[subprocess.Popen, Path]:
    """A fuzz session in the background; its stderr goes to OUT.err."""
    err = out.with_suffix(".err")
    cmd = [sys.executable, "-m", "fuzzshard", "fuzz", "--out", str(out), *map(str, args)]
    if "--loop" not in cmd:  # the seeds here were picked against the draws without the training loop (run_cli's)
        cmd += ["--loop", "none"]
    if setup:
        cmd += ["--worker-setup", str(PLANTED / setup)]
    with open(err, "w") as f:
        # its own process group: a signal to the whole group (a scheduler's cancel, `timeout`) reaches only it
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True), err


def _wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.5)
    return False


def _workers_of(out: Path) -> list[int]:
    """pids of live fuzzshard workers whose output goes to a log under OUT
    (named fuzzshard-rN, forked by the zygote or spawned)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().startswith("fuzzshard-r") \
                    and os.readlink(d / "fd" / "1").startswith(str(out)):
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def test_state_leaked_between_cases_is_called_contaminated_never_a_finding(tmp_path):
    """From its fourth case on, a planted leak makes a warm worker's SGD skip
    weight decay: the warm run diverges, the fresh confirmation passes."""
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "dtensor", "--max-examples", 30, "--world-sizes", "1,2", "--seed", 0,
                "--optimizers", "SGD", "--checkpoints", "none", "--out", out, setup="leak_between_cases.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(out.glob("*.json")), "a contaminated verdict was reported as a finding"
    records = [json.loads(p.read_text()) for p in (out / "contaminated").glob("*.json")]
    assert records, r.stderr[-3000:]
    rec = records[0]
    assert rec["signature"].startswith("dtensor.parity.SGD.") and rec["fresh_signature"] == "pass", rec
    assert rec["warm_verdict"]["oracle"] == "parity" and rec["fresh_verdict"]["status"] == "pass"
    assert len(rec["ran_before_in_that_generation"]) >= 3, rec  # the leak needs three cases before it
    assert f"CONTAMINATED (a fuzzshard internal error, not a finding): {rec['signature']}" in r.stderr


def test_a_killed_session_keeps_every_finding_it_saw_and_its_workers_go_with_it(tmp_path):
    out = tmp_path / "out"
    proc, err = _start(out, *BUG, "--duration", "10m", setup="skip_weight_decay.py")
    try:
        assert _wait_for(lambda: "new finding" in err.read_text(), 240), err.read_text()[-3000:]
        time.sleep(3)  # it shrinks now
        assert _workers_of(out)
    finally:
        proc.kill()
        proc.wait()
    announced = set(re.findall(r"new finding (\S+), confirmed", err.read_text()))
    found = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}  # whole files: each parses
    assert announced and announced <= set(found), (announced, sorted(found))
    for sig, f in found.items():
        assert f["signature"] == sig and f["stage"] in ("confirmed", "shrinking") and (out / f"{sig}.py").exists()
    assert _wait_for(lambda: not _workers_of(out), 20), "workers outlived their killed driver"
    sig = sorted(announced)[0]
    r = run_cli("replay", out / f"{sig}.json", setup="skip_weight_decay.py")
    assert r.returncode == 1 and f"FAIL: {sig}" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("sig, setup, code, group", [(signal.SIGINT, "skip_weight_decay.py", 1, False),
                                                     (signal.SIGTERM, None, 143, False),
                                                     (signal.SIGTERM, "skip_weight_decay.py", 1, True)],
                         ids=["sigint-with-findings", "sigterm-clean", "sigterm-to-the-group-with-findings"])
def test_a_signal_stops_the_session_after_its_current_case(tmp_path, sig, setup, code, group):
    """Ctrl-C or SIGTERM: the case that runs finishes, the files hold what was
    found; exit 1 with new findings, else 128 + the signal. The shell starts a
    background job with SIGINT ignored: fuzzshard installs its own handler.
    ``group``: the signal goes to the whole process group, workers included,
    as `timeout` and a batch scheduler's cancel send it: the same end, no traceback."""
    out = tmp_path / "out"
    proc, err = _start(out, *BUG, "--duration", "10m", setup=setup)
    try:
        ready = "new finding" if setup else "[fuzzshard] "
        assert _wait_for(lambda: ready in err.read_text(), 240), err.read_text()[-3000:]
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        assert proc.wait(timeout=60) == code, err.read_text()[-3000:]
    finally:
        proc.kill()
    text = err.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert f"{signal.Signals(sig).name}: stopping after the current case" in text
    assert f"stopped by {signal.Signals(sig).name}" in text
    written = sorted(p.stem for p in out.glob("*.json"))
    assert bool(written) == bool(setup), written
    for s in written:
        assert f"FINDING {s}" in text
    # the ranks ignore the group's signal, as they ignore Ctrl-C: the case running is never a crash by it
    assert not any(".crash." in s for s in written) and "CONTAMINATED" not in text, text[-3000:]


def test_duration_bounds_the_session_and_every_finding_is_1_minimal_however_short_the_shrink(tmp_path, monkeypatch):
    """A planted bug that shows in every optimizer keeps the shrinker busy, and Hypothesis's shrink is bounded
    at 1 s ($FUZZSHARD_HYPOTHESIS_SHRINK: as a busy machine or slow cases leave it next to nothing): the
    reducer, right after the round that found each finding and past --duration if it must, makes it
    1-minimal all the same (its file's reduction record and its "1-minimal" line say so); the session ends
    within --duration plus its last round's reduction (--shrink-budget) and its grace (a tenth of it, at
    least 20 s), as the session measures itself, and its files are confirmed."""
    monkeypatch.setenv("FUZZSHARD_HYPOTHESIS_SHRINK", "1")
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "dtensor", "--world-sizes", "1,2", "--seed", 2, "--checkpoints", "none",
                "--duration", "40s", "--shrink-budget", "90s", "--case-timeout", 20, "--out", out,
                setup="skip_weight_decay.py")
    assert r.returncode == 1, r.stderr[-3000:]
    m = re.search(r"session (\d+)s \(--duration 40s, a last round's reduction (\d+)s at most, grace (\d+)s\)", r.stderr)
    assert m, r.stderr[-3000:]
    assert int(m[2]) == 90 and int(m[1]) <= 40 + int(m[2]) + int(m[3]), m[0]
    found = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert found and all(f["stage"] == "confirmed" and f["deterministic"] for f in found)
    for f in found:
        assert f["signature"].startswith("dtensor.parity.") and f["reduction"]["minimal"] is True, f.get("reduction")
        assert re.search(rf"FINDING {re.escape(f['signature'])}\n.*\n(.*\n)?        1-minimal \(\d+ edited run",
                         r.stderr), r.stderr[-3000:]
    assert re.search(r"findings: \d+ new in \S+ \((\d+ \S+, )*\d+ reducing", r.stderr), r.stderr[-3000:]  # progress says so


def test_a_hang_shrinks_under_a_derived_timeout_and_is_confirmed_at_the_full_one(tmp_path):
    """Rank 1 blocks in any Adagrad step. Shrinking waits a timeout derived from
    the passing cases (well under --case-timeout); the finding's file holds a
    hang confirmed at the full timeout in fresh workers."""
    out = tmp_path / "out"
    r = run_cli("fuzz", "--target", "dtensor", "--max-examples", 12, "--world-sizes", "2,3", "--seed", 0,
                "--optimizers", "SGD,Adagrad", "--checkpoints", "none", "--case-timeout", 15, "--shrink-budget", "25s",
                "--out", out, setup="hang_in_adagrad.py")
    found = [json.loads(p.read_text()) for p in out.glob("dtensor.hang*.json")]
    assert found, r.stderr[-3000:]
    f = found[0]
    assert f["verdict"]["oracle"] == "hang" and "timeout" not in f["verdict"] and f["stage"] == "confirmed", f["verdict"]
    assert f["case"]["optim"]["name"] == "Adagrad" and f["case"]["world_size"] == 2, f["case"]
    m = re.search(r"while a hang shrank: (\d+) case\(s\) ran under a derived timeout of (\d+)s", r.stderr)
    assert m and int(m[1]) >= 1 and int(m[2]) < 15, r.stderr[-3000:]


def test_replay_exits_1_only_for_the_recorded_signature(tmp_path):
    from fuzzshard.findings.record import KNOWN_DIR

    finding = json.loads((KNOWN_DIR / "fsdp2.checkpoint.full.loaded.strict.json").read_text())
    finding["signature"] = "fsdp2.parity.Adam.forloop.param"  # as if another bug had been recorded
    other = tmp_path / "other.json"
    other.write_text(json.dumps(finding))
    r = run_cli("replay", other)
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    assert "recorded: fsdp2.parity.Adam.forloop.param" in r.stdout
    assert "now:      fsdp2.checkpoint.full.loaded.strict" in r.stdout


def test_replay_runs_a_case_on_the_device_it_was_recorded_on(tmp_path):
    from cases import simple_case

    case = json.loads(simple_case(1).to_json())
    case["device"] = "cuda"
    f = tmp_path / "cuda.json"
    f.write_text(json.dumps({"signature": "dtensor.parity.SGD.forloop.param", "case": case}))
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has a GPU")
    r = run_cli("replay", f)
    assert r.returncode == 2 and "no CUDA device" in r.stderr.strip().splitlines()[-1], r.stderr
