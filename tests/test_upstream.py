"""`fuzzshard upstream`: a finding as an issue-ready report for pytorch/pytorch."""
import re

from conftest import run_cli

from fuzzshard.findings.record import KNOWN_DIR


def test_a_silent_known_finding_reports_its_hand_reduced_script_and_the_recorded_numbers_as_such(tmp_path):
    out = tmp_path / "issue.md"
    r = run_cli("upstream", KNOWN_DIR / "dtensor.parity.forward.Conv1d.json", "-o", out, "--no-run")
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    # its root cause is filed upstream (open): a comment for that issue, said first, not a new issue
    assert text.startswith("Already filed upstream: pytorch/pytorch#186129 (open) — "
                           "https://github.com/pytorch/pytorch/issues/186129\n"), text[:300]
    assert "### Comment for pytorch/pytorch#186129" in text and "### Versions" in text and "Title:" not in text
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
    issues = 0
    for sig, finding, text, _ in _reports():
        rc = causes[finding.root_cause]
        if text.startswith("Already filed upstream"):  # a comment for the filed issue: no title of its own
            assert "Title:" not in text and rc.title not in text, sig
            continue
        issues += 1
        title = text.splitlines()[0]
        assert title.startswith(f"Title: [{rc.component}] ") and rc.title.endswith(title.split("] ", 1)[1]), sig
        words = title.split("] ", 1)[1]
        described = text.split("### 🐛 Describe the bug\n\n", 1)[1]
        if rc.what:  # a cut title: the bug in full is the description, said first
            assert described.startswith(rc.what), sig
            described = described[len(rc.what):].lstrip(".\n")
        assert words not in described, sig  # in the title (and its full text) only: no restatement beside it
        what = described.split("\n", 1)[0]  # one sentence of what happens
        assert what.endswith(".") and what.count(". ") == 0 and text.count(what) == 1, (sig, what)
    assert issues >= 4


# ---- a report of a finding made on another torch, and of a bug already filed upstream

def _variant(sig: str, torch_version: str, signature: str | None = None, line_to: int | None = None):
    """Known finding ``sig`` as if found on ``torch_version`` (under ``signature``: a new face of its root
    cause), its traceback's torch lines moved to ``line_to`` (lines this torch's files do not have there)."""
    import json

    from fuzzshard.findings.record import Finding

    data = json.loads((KNOWN_DIR / f"{sig}.json").read_text())
    data["environment"] = {**data["environment"], "torch": torch_version}
    data["signature"] = signature or data["signature"]
    err = data["verdict"].get("error") or {}
    if line_to and err.get("traceback"):
        err["traceback"] = re.sub(r'(/torch/[^"]+\.py", line )\d+', rf"\g<1>{line_to}", err["traceback"])
    return Finding.from_dict(data)


def _report(finding):
    from fuzzshard.findings.record import load_known
    from fuzzshard.report.upstream import report

    return report(finding, load_known(), run=False)[0]


def test_the_suspected_source_is_linked_at_the_findings_torch_with_its_tracebacks_line():
    # an error found on torch 2.11: the tag of 2.11 and the line of its own traceback, never this torch's
    text = _report(_variant("dtensor.error.step.NotImplementedError.af1d5b0d._fused_sgd_", "2.11.0+cu130",
                            line_to=4321))
    src = next(ln for ln in text.splitlines() if ln.startswith("**Suspected source**"))
    assert re.search(r"`torch/distributed/tensor/_sharding_prop\.py:4321` \(\w+\) — https://github\.com/pytorch/"
                     r"pytorch/blob/v2\.11\.0/torch/distributed/tensor/_sharding_prop\.py#L4321", src), src
    assert "v2.13" not in src and "v2.11.0" in src


def test_a_root_causes_api_on_another_torch_links_the_file_without_this_torchs_line():
    # a silent bug has no traceback: its function's line is known only in the torch installed here
    import torch

    from fuzzshard.oracle.source import line_of

    sig = "dtensor.checkpoint.broadcast.loaded.state.missing"  # dsd-frozen-param-optim-state-dropped
    other = _report(_variant(sig, "2.11.0+cu130"))
    assert "`torch/distributed/checkpoint/state_dict.py` (_split_optim_state_dict) — https://github.com/pytorch/" \
           "pytorch/blob/v2.11.0/torch/distributed/checkpoint/state_dict.py\n" in other
    here = _report(_variant(sig, torch.__version__))
    line = line_of("torch/distributed/checkpoint/state_dict.py", "_split_optim_state_dict")
    tag = "v" + torch.__version__.split("+")[0]
    assert f"`torch/distributed/checkpoint/state_dict.py:{line}` (_split_optim_state_dict) — https://github.com/" \
           f"pytorch/pytorch/blob/{tag}/torch/distributed/checkpoint/state_dict.py#L{line}" in here


def test_source_ref_is_the_torch_builds_own_tag_or_commit():
    from fuzzshard.report.upstream import source_ref

    assert source_ref({"torch": "2.11.0+cu130"}) == ("v2.11.0", "")
    assert source_ref({"torch": "2.10.0"}) == ("v2.10.0", "")
    assert source_ref({"torch": "2.12.0rc3"}) == ("v2.12.0-rc3", "")
    assert source_ref({"torch": "2.14.0a0+git1a2b3c4"}) == ("1a2b3c4", "")
    assert source_ref({"torch": "2.14.0.dev20261101+cpu", "torch_git": "0123456789abcdef0123"}) == \
        ("0123456789abcdef0123", "")
    ref, note = source_ref({"torch": "2.14.0.dev20261101+cpu"})
    assert ref == "v2.14.0" and "nearest release tag" in note
    assert source_ref({}) == ("", "")


def test_a_bug_filed_upstream_open_gets_a_comment_for_its_issue_not_a_new_issue():
    # a new face of dsd-frozen-param-optim-state-dropped (pytorch/pytorch#192202, open), found on 2.11
    text = _report(_variant("dtensor.checkpoint.broadcast.loaded.state.missing", "2.11.0+cu130",
                            signature="fsdp2.checkpoint.broadcast.loaded.state.exp_avg"))
    lines = text.splitlines()
    assert lines[0] == "Already filed upstream: pytorch/pytorch#192202 (open) — " \
                       "https://github.com/pytorch/pytorch/issues/192202", lines[:3]
    assert lines[1] == "Post what follows there as a comment, not as a new issue."
    assert "### Comment for pytorch/pytorch#192202" in text and "Title:" not in text
    assert "Another form of this bug, found on torch 2.11.0+cu130 (" in text
    assert "```python\n" in text and "### Versions" in text and "found on: torch 2.11.0+cu130" in text
    # a known face of it is the same bug again
    again = _report(_variant("dtensor.checkpoint.broadcast.loaded.state.missing", "2.13.0+cpu"))
    assert "This bug again, found on torch 2.13.0+cpu (" in again and "Another form" not in again


def test_a_bug_closed_upstream_says_to_check_for_the_fix_and_its_release_where_recorded(monkeypatch):
    sig = "fsdp1.error.save.RuntimeError.acd33f0e"  # fsdp1-full-state-dict-cpu-offload-freed-storage: closed
    text = _report(_variant(sig, "2.11.0+cpu"))
    assert text.startswith("Already filed upstream: pytorch/pytorch#188989 (closed) — "
                           "https://github.com/pytorch/pytorch/issues/188989\n"), text[:200]
    assert "Closed upstream: check whether your release has the fix." in text and "fixed in" not in text
    from fuzzshard.findings import rootcause

    loaded = rootcause.load_root_causes

    def with_fix(*a, **kw):  # as if `fuzzshard bisect` had recorded its fix
        causes = loaded(*a, **kw)
        causes["fsdp1-full-state-dict-cpu-offload-freed-storage"].fixed_in = "2.14.0"
        return causes

    monkeypatch.setattr(rootcause, "load_root_causes", with_fix)
    assert "Closed upstream: check whether your release has the fix (fixed in torch 2.14.0, as recorded)." \
        in _report(_variant(sig, "2.11.0+cpu"))


def test_a_bug_not_filed_is_a_new_issue_with_a_short_title_and_the_bug_in_full_below_it():
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes
    from fuzzshard.report.upstream import title

    known = load_known()
    rc = load_root_causes(known)["zero-bucket-view-frozen-param-not-broadcast"]  # not reported, its title cut
    sig = rc.signatures[0]
    text = _report(known[sig])
    assert text.startswith(f"Title: [ZeRO] {rc.title}\n")
    assert text.split("### 🐛 Describe the bug\n\n", 1)[1].startswith(rc.what)
    causes = load_root_causes(known)
    for f in known.values():  # every issue title is short: a root cause's, and a new finding's as its oracle says it
        for rc in (causes.get(f.root_cause), None):
            assert len(title(f, rc).split("] ", 1)[1]) <= 120, title(f, rc)


# ---- issue 45: what the script runs on, references in full, no internal ids, the root cause's source

def test_references_to_other_repositories_are_written_in_full():
    from fuzzshard.report.upstream import full_refs

    assert full_refs("downstream, meta-pytorch/torchrec#3809 and #3891 filter empty grads") == \
        "downstream, meta-pytorch/torchrec#3809 and meta-pytorch/torchrec#3891 filter empty grads"
    assert full_refs("a/b#1, #2 / #3 or #4; #5") == "a/b#1, a/b#2 / a/b#3 or a/b#4; #5"
    same = "pytorch/pytorch#1 and #2; PR #3, the fix of #4 (closed); downstream X-Y/z.w#5 works around it"
    assert full_refs(same) == same  # pytorch's own (bare #N links there) and a lone full reference stay


def test_no_report_note_names_a_root_cause_by_its_id_or_another_repositorys_issue_bare():
    """Every root cause's words a report may quote (its related-upstream note, its description)."""
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes
    from fuzzshard.report.upstream import _no_ids, _plain, _related

    causes = load_root_causes(load_known())
    named = 0
    for rc in causes.values():
        for said in (_related(rc), _plain(rc.what)):
            text = _no_ids(said, causes)
            named += text != said
            assert not [rid for rid in causes if rid in text], (rc.id, text)
            other = re.findall(r"(?<![\w/])([\w.-]+/[\w.-]+)#\d+((?:\s*(?:,|/|and|or)\s*#\d+)+)", text)
            assert not [o for o in other if o[0] != "pytorch/pytorch"], (rc.id, text)
    assert named >= 2  # (two notes name another root cause by its id today: said in their titles' words)


def _report_of(sig, run=False):
    from fuzzshard.findings.record import load_known
    from fuzzshard.report.upstream import report

    known = load_known()
    return report(known[sig], known, run=run)[0]


def test_to_reproduce_says_the_device_and_backend_the_script_needs():
    said = {sig: re.search(r"To reproduce[^:]*\(torch only; ([^)]*)\)|torch only; ([^;]*);", _report_of(sig))
            for sig in ["zero.error.step.AssertionError.21873372",  # hand-reduced: one GPU, NCCL
                        "fsdp1.checkpoint.full.loaded.param",  # hand-reduced: one GPU, no process group
                        "fsdp2.error.load.ValueError.6e555fc1",  # generated from a CUDA case
                        "fsdp2.compiled_ckpt.parity.grad",  # hand-reduced: one process on the CPU
                        "dtensor.parity.forward.Conv1d"]}  # hand-reduced: 2 ranks on gloo
    got = {sig: (m.group(1) or m.group(2)) for sig, m in said.items()}
    assert got == {"zero.error.step.AssertionError.21873372": "one GPU, NCCL",
                   "fsdp1.checkpoint.full.loaded.param": "one GPU, no process group",
                   "fsdp2.error.load.ValueError.6e555fc1": "one GPU, NCCL",
                   "fsdp2.compiled_ckpt.parity.grad": "CPU, no process group",
                   "dtensor.parity.forward.Conv1d": "CPU, gloo"}, got


def test_a_script_that_needs_gpus_this_machine_lacks_is_not_run_and_the_report_says_why(monkeypatch):
    import pytest
    import torch

    from fuzzshard.report import upstream

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")

    def refuse(*a, **kw):
        raise AssertionError("a CUDA script was run on a machine without CUDA")

    monkeypatch.setattr(upstream, "_run", refuse)
    monkeypatch.setattr(upstream, "_versions", lambda finding, collect: "versions")
    text = _report_of("zero.error.step.AssertionError.21873372", run=True)
    assert "The script was not run for this report (it needs one GPU, and this machine has none): what follows " \
           "is from the run in which the bug was found" in text and "Output (torch" not in text


def test_the_suspected_source_is_the_root_causes_own_even_where_the_finding_fails_elsewhere():
    # pp-unequal-microbatches-first-shape: the receive buffers keep the first microbatch's shape; its loss face
    # has no traceback, its error face raises in stage_backward: both name where the buffers are made
    for sig in ("pp.parity.loss", "pp.error.fwdbwd.RuntimeError.8b343f1a"):
        src = next(ln for ln in _report_of(sig).splitlines() if ln.startswith("**Suspected source**"))
        assert "`torch/distributed/pipelining/stage.py:" in src and "_setup_forward_recv_info" in src, (sig, src)
        assert "_backward.py" not in src, (sig, src)
