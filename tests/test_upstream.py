"""`fuzzshard upstream`: a finding as an issue-ready report for pytorch/pytorch."""
import re

from conftest import run_cli, torchrun

from fuzzshard.findings import KNOWN_DIR


def test_a_silent_known_finding_reports_its_hand_reduced_script_and_the_script_runs(tmp_path):
    out = tmp_path / "issue.md"
    r = run_cli("upstream", KNOWN_DIR / "dtensor.parity.forward.Conv1d.json", "-o", out, "--no-run")
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("Title: [DTensor] ") and "### 🐛 Describe the bug" in text and "### Versions" in text
    minimal = (KNOWN_DIR / "minimal" / "min_conv_partial_input.py").read_text()
    assert "```python\n" + minimal.rstrip() + "\n```" in text  # the hand-reduced script, whole
    # expected vs actual with numbers, and the torch source suspected at this torch's line
    assert re.search(r"\| forward \| Conv1d \| 0 \| -?[\d.e-]+ \| -?[\d.e-]+ \| [\d.e-]+ \| [\d.e-]+ \| 27/27 \|", text), text
    assert re.search(r"\*\*Suspected source\*\*: `torch/distributed/tensor/_tp_conv.py:\d+` \(convolution_handler\)", text)
    # the script as the report holds it fails under torchrun on this torch: the bug reproduces
    script = tmp_path / "min.py"
    script.write_text(re.search(r"```python\n(.*?)\n```", text, re.S).group(1) + "\n")
    ran = torchrun(script, 2, cwd=tmp_path)
    assert ran.returncode == 1 and "BUG REPRODUCED" in ran.stdout, ran.stdout + ran.stderr[-2000:]


def test_a_finding_without_a_reduced_script_carries_the_generated_one(tmp_path):
    out = tmp_path / "issue.md"
    r = run_cli("upstream", KNOWN_DIR / "fsdp2.error.step.NotImplementedError.af1d5b0d._fused_sgd_.json", "-o", out, "--no-run")
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    # the straight-line script (scriptgen.py) is short enough for the issue body: nothing attached
    assert "torchrun --nproc-per-node 1 repro.py" in text and "def main():" in text and "fully_shard(" in text
    assert not (tmp_path / "issue.repro.py").exists()
    assert "**Expected**: the sharded run trains" in text and "NotImplementedError" in text


def test_upstream_of_a_broken_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run_cli("upstream", bad)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_silent_root_cause_has_a_hand_reduced_script_that_says_how_to_run_it():
    from fuzzshard.findings import load_known
    from fuzzshard.rootcause import load_root_causes
    from fuzzshard.upstream import _ROOT

    causes = load_root_causes(load_known())
    silent = [rc for rc in causes.values() if rc.kind == "silent"]
    assert silent and all(rc.minimal for rc in silent), [rc.id for rc in silent if not rc.minimal]
    for rc in causes.values():
        if rc.minimal:
            top = "\n".join((_ROOT / rc.minimal).read_text().splitlines()[:15])
            name = re.escape(rc.minimal.rsplit("/", 1)[1])
            assert re.search(rf"(torchrun --nproc-per-node \d+|python) {name}", top), rc.id


def test_known_minimal_runs_a_root_causes_hand_reduced_script_and_says_it_still_reproduces():
    r = run_cli("known", "--minimal", "zero-generator-param-group-consumed")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"zero-generator-param-group-consumed +still reproduces +BUG REPRODUCED", r.stdout), r.stdout
    bad = run_cli("known", "--minimal", "no-such-root-cause")
    assert bad.returncode == 2 and "unknown root cause(s) no-such-root-cause" in bad.stderr
