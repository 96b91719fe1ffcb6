"""`fuzzshard upstream`: a finding as an issue-ready report for pytorch/pytorch."""
import re

from conftest import run_cli

from fuzzshard.findings.record import KNOWN_DIR


def test_a_silent_known_finding_reports_its_hand_reduced_script_and_the_recorded_numbers_as_such(tmp_path):
    out = tmp_path / "issue.md"
    r = run_cli("upstream", KNOWN_DIR / "dtensor.parity.forward.Conv1d.json", "-o", out, "--no-run")
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("Title: [DTensor] ") and "### 🐛 Describe the bug" in text and "### Versions" in text
    minimal = (KNOWN_DIR / "minimal" / "min_conv_partial_input.py").read_text()
    assert "```python\n" + minimal.rstrip() + "\n```" in text  # the hand-reduced script, whole
    # not run: the numbers are the recorded run's, and the report says so (and whose world size)
    assert "Output (torch" not in text
    assert "The script was not run for this report: what follows is from the run in which the bug was found " \
           "(2 ranks, torch " in text and "not from the script above" in text
    # expected vs actual with numbers, the rounding they exceed in words, the torch source at this torch's line
    assert re.search(r"\| output of `layers\.1\.conv` \(Conv1d\) \| 0 \| -?[\d.e-]+ \| -?[\d.e-]+ \| [\d.e-]+ \| [\d.e-]+ "
                     r"\| 1/1 \|", text), text
    assert re.search(r"differs by more than float32 rounding of sums of up to 22 terms in another order allows: "
                     r"0\.043 vs at most 3\.5e-07\.", text), text
    assert re.search(r"\*\*Suspected source\*\*: `torch/distributed/tensor/_tp_conv.py:\d+` \(convolution_handler\)", text)


def test_with_run_the_report_quotes_the_shown_scripts_own_output_and_takes_expected_actual_from_it(tmp_path):
    """The one torchrun run here: the hand-reduced script the report shows runs on its own 2 ranks
    and its printed lines are the evidence; the recorded run's numbers do not appear beside them."""
    out = tmp_path / "issue.md"
    r = run_cli("upstream", KNOWN_DIR / "dtensor.parity.forward.Conv1d.json", "-o", out)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    block = re.search(r"Output \(torch [^,]+, 2 ranks\):\n\n```\n(.*?)\n```", text, re.S)
    assert block, text
    printed = block.group(1)
    assert "conv output placements: (Replicate(),)" in printed and printed.splitlines()[-1] == "BUG REPRODUCED", printed
    assert "Traceback" not in printed  # torchrun's own report of the failed exit is not the script's output
    assert "**actual**: what the script prints above (`BUG REPRODUCED`), exit code 1." in text
    assert "1/1 |" not in text and "The script was not run" not in text  # not the recorded run's numbers
    assert "PyTorch version:" in text  # torch.utils.collect_env


def test_upstream_of_a_broken_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run_cli("upstream", bad)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_silent_root_cause_has_a_hand_reduced_script_that_says_how_to_run_it():
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes
    from fuzzshard.report.upstream import _ROOT

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


# one known finding of each oracle and script kind: a hand-reduced script (parity, checkpoint, a harness
# check), the generated straight-line one (error parity), the flattened one, attached (crash, hang)
_FACES = ["dtensor.parity.AdamW.fused.param.noncontig_grad", "fsdp1.checkpoint.broadcast.loaded.param",
          "dtensor.checkpoint.full.loaded.strict", "dtensor.error.fwdbwd.AssertionError.1d761c6b",
          "zero.error.ctor.GroupsLost.a91d13e2", "fsdp1.crash.Killed_by_SIGABRT.other.all_gather_single",
          "zero.hang.other.all_reduce", "dtensor.error.step.NotImplementedError.af1d5b0d._fused_sgd_"]
CREDIT = "Found by fuzzshard, a property-based fuzzer of sharded training."
# the fuzzer's own words and this repository's paths: none reaches a maintainer
JARGON = re.compile(r"parity:|\d+\*?\d* ulps|signature|oracle|anchored|fuzzshard|shrunk|"
                    r"minimal/|known/|THIS_FILE|\bface\b|world size \d", re.I)


def _reports():
    from fuzzshard.findings.record import load_known
    from fuzzshard.report.upstream import report

    known = load_known()
    return [(sig, known[sig], *report(known[sig], known, run=False)) for sig in _FACES]


def test_a_report_speaks_torch_not_the_fuzzer_and_names_no_repository_path():
    for sig, finding, text, attach in _reports():
        assert text.rstrip().endswith(CREDIT), sig  # the one line that names the tool, at the end
        body = text.rstrip()[:-len(CREDIT)]
        said = sorted({m.group(0) for m in JARGON.finditer(body)})
        assert not said, (sig, said, [ln for ln in body.splitlines() if JARGON.search(ln)])
        for name, script in attach.items():  # a flattened script is attached by its file name, not inlined
            assert f"the attached `{name}`" in text and script[:2000] not in text, sig


def test_a_report_says_the_bug_once():
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes

    causes = load_root_causes(load_known())
    for sig, finding, text, _ in _reports():
        title = text.splitlines()[0]
        rc = causes[finding.root_cause]
        assert title.startswith(f"Title: [{rc.component}] ") and rc.title.endswith(title.split("] ", 1)[1]), sig
        words = title.split("] ", 1)[1]
        assert text.count(words) == 1, sig  # in the title only: no restatement, no diagnosis beside it
        what = text.split("### 🐛 Describe the bug\n\n", 1)[1].split("\n", 1)[0]  # one sentence of what happens
        assert what.endswith(".") and what.count(". ") == 0 and text.count(what) == 1, (sig, what)
