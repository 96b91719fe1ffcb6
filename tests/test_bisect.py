"""`fuzzshard bisect`: what a finding's outcomes over torch releases say (first bad, last good, fixed in), the
table, the known list's records (seen_on, root_causes.json's fixed_in, the README), and the command on this
python's torch alone."""
import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuzzshard.findings import knownlist, releases
from fuzzshard.findings.record import load_finding, load_known

ROOT = Path(__file__).resolve().parent.parent
KNOWN = ROOT / "fuzzshard" / "known"
R, P = "reproduces", "fixed"  # stored words: "fixed" is a pass, shown as "passes"


def test_releases_sort_as_releases_not_text():
    assert sorted(["2.10.0", "2.9.1", "2.15.0", "2.13.0"], key=releases.release_key) == [
        "2.9.1", "2.10.0", "2.13.0", "2.15.0"]


def test_a_regression_has_a_first_bad_and_the_last_good_before_it():
    got = {"2.10.0": R, "2.9.1": P, "2.13.0": R, "2.15.0": R}
    assert releases.first_bad(got) == "2.10.0"  # not "2.13.0", which sorts first as text
    assert releases.last_good(got) == "2.9.1"
    assert releases.fixed_in(got) is None


def test_a_fix_is_a_pass_right_after_a_reproduction_that_lasts():
    assert releases.fixed_in({"2.13.0": R, "2.14.1": R, "2.15.0": P}) == "2.15.0"
    assert releases.fixed_in({"2.13.0": R, "2.14.1": "skipped", "2.15.0": P}) == "2.15.0"  # no evidence between
    assert releases.fixed_in({"2.13.0": R, "2.14.1": P, "2.15.0": R}) is None  # came back: no fix
    assert releases.fixed_in({"2.13.0": "differs (x)", "2.14.1": P}) is None  # never seen reproducing
    assert releases.fixed_in({"2.9.1": P, "2.13.0": R}) is None  # a pass before the bug is no fix


def test_last_good_is_unknown_when_the_release_before_fails_otherwise():
    got = {"2.9.1": P, "2.10.0": "differs (other.sig)", "2.13.0": R}
    assert releases.first_bad(got) == "2.13.0" and releases.last_good(got) is None
    assert releases.last_good({"2.13.0": R}) is None and releases.first_bad({"2.13.0": P}) is None


def test_a_root_cause_is_fixed_only_where_all_its_findings_pass():
    both = releases.root_cause_states([{"2.13.0": R, "2.15.0": P}, {"2.13.0": R, "2.15.0": P}, {}])
    assert both == {"2.13.0": R, "2.15.0": P}  # a finding that never ran (CUDA only) is no evidence
    sample = releases.root_cause_states([{"2.13.0": R, "2.15.0": P}, {"2.13.0": R}])
    assert sample["2.15.0"] == "unchecked" and releases.fixed_in(sample) is None
    assert releases.root_cause_states([{"2.13.0": P}, {"2.13.0": "differs (y)"}]) == {"2.13.0": "differs"}


def _run(results: dict, seconds=5.0, notes=None) -> dict:
    return {"torch": "", "results": results, "notes": notes or {}, "seconds": seconds}


def test_the_table_for_one_finding_has_a_row_per_release_and_the_other_signature():
    runs = {"2.9.1": _run({"a.json": "differs (dtensor.error.x)"}, notes={}),
            "2.13.0": _run({"a.json": R}), "2.15.0": _run({"a.json": P}, 7.4)}
    lines = releases.table(["a.json"], {"a.json": "sig.a"}, runs)
    assert lines[:5] == ["sig.a", "  release    outcome", "  2.9.1      fails otherwise (dtensor.error.x)",
                         "  2.13.0     reproduces", "  2.15.0     passes"]
    assert "first bad: 2.13.0" in lines and "last good: unknown (it fails otherwise on the release before)" in lines and "fixed in:  2.15.0" in lines
    assert lines[-1] == "wall time: 2.9.1 5s, 2.13.0 5s, 2.15.0 7s"


def test_the_table_for_several_findings_has_a_row_each():
    runs = {"2.10.0": _run({"a.json": P, "b.json": R}), "2.9.1": _run({"a.json": P, "b.json": "differs (c.d)"}),
            "2.13.0": _run({"a.json": R, "b.json": "skipped"})}
    lines = releases.table(["a.json", "b.json"], {"a.json": "sig.a", "b.json": "sig.b"}, runs)
    header, a, b = lines[:3]
    assert header.split() == ["finding", "2.9.1", "2.10.0", "2.13.0", "first", "bad", "last", "good", "fixed", "in"]
    assert a.split() == ["sig.a", "ok", "ok", "bad", "2.13.0", "2.10.0", "-"]
    assert b.split() == ["sig.b", "other", "bad", "-", "2.10.0", "-", "-"]
    assert "  sig.b on 2.9.1: fails otherwise (c.d)" in lines


def test_the_readme_table_names_a_regression_by_its_last_good_release():
    f = next(iter(load_known().values()))
    known = {"a": f.__class__("a", f.case, f.verdict, root_cause="bug-a", seen_on={"2.10.0": P, "2.13.0": R}),
             "b": f.__class__("b", f.case, f.verdict, root_cause="bug-a", seen_on={"2.10.0": P, "2.13.0": P})}
    rows = releases.regression_table(known, {})
    assert rows[-1] == "| `bug-a` | passes 0/2/0 | reproduces 1/1/0 | 2.13.0 | 2.10.0 | - |", rows


@pytest.fixture
def known_dir(tmp_path):
    d = tmp_path / "known"
    shutil.copytree(KNOWN, d)
    for f in d.glob("*.json"):  # a clean slate: what the real list recorded is not this test's input
        data = json.loads(f.read_text())
        if isinstance(data, dict) and data.pop("seen_on", None) is not None:
            f.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    causes = json.loads((d / "root_causes.json").read_text())
    for c in causes.values():
        c.pop("fixed_in", None)
    (d / "root_causes.json").write_text(json.dumps(causes, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return d


def _fixed_in(known_dir) -> dict:
    from fuzzshard.findings.rootcause import load_root_causes

    return {rid: rc.fixed_in for rid, rc in load_root_causes(known_dir=known_dir).items() if rc.fixed_in}


def test_recording_a_fix_adds_only_fixed_in_to_root_causes_and_a_note_to_older_findings(known_dir):
    rid = "dtensor-conv-handlers-skip-redistribution"
    sigs = sorted(s for s, f in load_known(known_dir).items() if f.root_cause == rid)
    before = (known_dir / "root_causes.json").read_text()
    res = [{"torch": "2.13.0+cpu", "results": {str(known_dir / f"{s}.json"): R for s in sigs}},
           {"torch": "2.15.0+cu130", "results": {s: P for s in sigs[:-1]}}]
    knownlist.record_known(res, known_dir)
    assert _fixed_in(known_dir) == {}  # one finding not checked on 2.15.0: no evidence for it
    knownlist.record_known([{"torch": "2.15.0", "results": {sigs[-1]: P}}], known_dir)
    after = (known_dir / "root_causes.json").read_text()
    changed = [d[:1] + d[2:] for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[:1] in "+-"]
    assert changed == ['+    "fixed_in": "2.15.0",']
    assert _fixed_in(known_dir) == {rid: "2.15.0"}
    f = load_finding(known_dir / f"{sigs[0]}.json")
    assert f.seen_on == {"2.13.0": R, "2.15.0": P}
    readme = (known_dir / "README.md").read_text()
    assert f"| `{rid}` | reproduces {len(sigs)}/0/0 | passes 0/{len(sigs)}/0 | 2.13.0 | - | **2.15.0** |" in readme
    f.environment["torch"] = "2.14.1+cu130"
    assert knownlist.fixed_in_note(f, known_dir=known_dir) == (
        f"fixed in torch 2.15.0 (root cause {rid}; this finding was made on 2.14.1)")
    f.root_cause = ""  # a new finding with a known signature: the known one's root cause
    assert knownlist.fixed_in_note(f, known_dir=known_dir).startswith("fixed in torch 2.15.0")
    f.environment["torch"] = "2.15.0"
    assert knownlist.fixed_in_note(f, known_dir=known_dir) == ""


def _bisect(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fuzzshard", "bisect", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("args, says", [
    (["--torch", "2.x"], "not a list of torch releases"),
    (["--torch", "2.8.0"], "older than fuzzshard's floor"),
    (["--record"], "--record writes the known list's files: give --known"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, tmp_path):
    got = _bisect(str(KNOWN / "dtensor.parity.forward.Conv1d.json"), "--venvs", str(tmp_path), *args)
    assert got.returncode == 2 and says in got.stderr and len(got.stderr.strip().splitlines()) == 1, got


def test_a_broken_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    got = _bisect(str(bad), "--venvs", str(tmp_path))
    assert got.returncode == 2 and "broken.json" in got.stderr and len(got.stderr.strip().splitlines()) == 1, got


def test_bisect_on_this_python_says_a_known_finding_reproduces(tmp_path):
    """The one real replay: this python's torch (the pin) as the only release, no venv in --venvs."""
    from fuzzshard.versions import installed_torch

    here = releases.release_of(installed_torch())
    sig = "dtensor.parity.forward.Conv1d"
    got = _bisect(str(KNOWN / f"{sig}.json"), "--torch", here, "--venvs", str(tmp_path / "none"),
                  "--json", str(tmp_path / "out.json"))
    assert got.returncode == 0, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    assert lines[lines.index(sig) + 2].split() == [here, "reproduces"], got.stdout
    assert f"first bad: {here}" in lines
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["releases"][here]["results"] == {str(KNOWN / f"{sig}.json"): R}


def test_a_root_cause_fixed_later_says_so_for_an_older_release_and_show_and_upstream_say_it_too():
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import RootCause
    from fuzzshard.report.show import render
    from fuzzshard.report.upstream import report

    rc = RootCause("r", "t", fixed_in="2.15.0")
    assert rc.fixed_after("2.13.0+cpu") == "fixed in torch 2.15.0" == rc.fixed_after("2.9.1")
    assert rc.fixed_after("2.15.0") == rc.fixed_after("2.15.1+cu130") == rc.fixed_after("") == ""
    assert RootCause("r", "t").fixed_after("2.13.0") == ""
    known = load_known()
    f = known["fsdp2.error.step.RuntimeError.61658fa9"]  # rprop-forloop-bool-mask-inplace-on-shard: fixed in 2.15.0
    assert f.environment["torch"].startswith("2.13.0")
    assert ("release   fixed in torch 2.15.0 (root cause rprop-forloop-bool-mask-inplace-on-shard; this finding "
            "was made on 2.13.0)") in render(f)
    text, _ = report(f, known, run=False)
    assert "(Already fixed in torch 2.15.0: this was found on torch 2.13.0" in text


def test_no_venv_and_no_torch_is_refused_not_a_bisection_of_one_release(tmp_path):
    """Without --torch and with no venv cached, only this python's torch is there: one release bisects nothing,
    which is said (exit 2, one line) instead of a table of one row."""
    from fuzzshard.versions import installed_torch

    got = _bisect(str(KNOWN / "dtensor.parity.forward.Conv1d.json"), "--venvs", str(tmp_path / "none"))
    here = releases.release_of(installed_torch())
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got
    assert "no torch venv in" in got.stderr and "no --torch" in got.stderr and f"--torch {here}" in got.stderr
    assert got.stdout == ""
