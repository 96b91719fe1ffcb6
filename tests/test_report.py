"""`fuzzshard report`: new findings and known hits apart everywhere, findings
grouped by suspected root cause, coverage of the dimensions where bugs hide,
labelled charts. From a hand-written cells log, so every count is known."""
import json
import re

from conftest import run_cli

from fuzzshard.findings.record import KNOWN_DIR

KNOWN_SIG = "fsdp2.checkpoint.full.loaded.strict"  # root cause dsd-full-load-refills-missing-keys
NEW_SIG = "dtensor.parity.SGD.forloop.param"  # written by "this run"


def _case(t, outcome, optim="SGD", impl="forloop", **more):
    status, sig, known = {"pass": ("pass", None, False), "invalid": ("invalid", None, False),
                          "new": ("finding", NEW_SIG, False), "new-again": ("finding", NEW_SIG, True),
                          "known": ("finding", KNOWN_SIG, True)}[outcome]
    return {"t": t, "target": more.get("target", "dtensor"), "world": more.get("world", 2), "mesh": 1,
            "ck": more.get("ck"), "ck_world": more.get("ck_world"), "optim": optim, "impl": impl, "dtype": "float32",
            "steps": 1, "options": more.get("options", ["placements=S0"]), "groups": more.get("groups", 1),
            "frozen": more.get("frozen", False), "procs": 1, "status": status, "oracle": None, "sig": sig,
            "known": known}


def test_report_tells_new_findings_from_known_hits_and_groups_them_by_root_cause(tmp_path):
    out = tmp_path / "soak"
    (out / "cells").mkdir(parents=True)
    (out / "findings").mkdir()
    lines = [_case(0, "pass", "Adam", "foreach"), _case(10, "known", "Adam", "fused", target="fsdp2", ck="full",
                                                         ck_world=2, options=["reshard_after_forward=True"]),
             _case(20, "new"), _case(30, "invalid", groups=2, frozen=True), _case(40, "new-again"),
             _case(60, "pass", "Adamax", "forloop", world=1, ck="dcp", ck_world=2)]
    (out / "cells" / "e0c0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    finding = json.loads((KNOWN_DIR / "dtensor.parity.Adafactor.forloop.param.json").read_text())
    finding["signature"] = NEW_SIG
    finding.pop("root_cause")
    (out / "findings" / f"{NEW_SIG}.json").write_text(json.dumps(finding))

    r = run_cli("report", out)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "6 cases in 1.0 min" in text and "1 new finding in 1 suspected bug ·" in text, text
    assert "1 known-bug hit in 1 root cause" in text, text
    # the new finding under its suspected root cause, hit twice (a resumed cell calls its own finding known)
    assert re.search(r"^  (root cause \S+ \(probably\)|new: .+): 1 finding\(s\)\n +0\.3  x2 +" + re.escape(NEW_SIG),
                     text, re.M), text
    assert re.search(r"^  x1 +dsd-full-load-refills-missing-keys +\[", text, re.M), text
    # columns: cases, pass, invalid, new finding, known hit, error
    assert re.search(r"^  SGD forloop +3 +0 +1 +2 +0 +0$", text, re.M), text
    assert re.search(r"^  Adam fused +1 +0 +0 +0 +1 +0$", text, re.M), text
    assert re.search(r"^  dcp W1 -> W2 +1 +1 +0 +0 +0 +0$", text, re.M), text
    assert re.search(r"^  fsdp2: reshard_after_forward=True +1 ", text, re.M), text
    assert re.search(r"^  some +1 +0 +1 +0 +0 +0$", text, re.M), text  # frozen params
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 3
    for label in ("world size", "target", "minutes into the run", "new findings", "cases/s"):
        assert f"font-weight='bold'>{label}<" in page or f">{label}</text>" in page, label
    assert NEW_SIG in page and "dsd-full-load-refills-missing-keys" in page


def test_the_page_cuts_text_at_words_and_links_upstream_issues():
    from fuzzshard.report.page import clip, linked

    text = "error parity: only the sharded run raises, in step 0: a bare AssertionError in torch"
    assert clip(text, 40) == "error parity: only the sharded run…" and clip(text, 200) == text
    assert linked("pytorch/pytorch#186129 (open)") == \
        "<a href='https://github.com/pytorch/pytorch/issues/186129'>pytorch/pytorch#186129</a> (open)"
    assert linked("by design: <a> reason") == "by design: &lt;a&gt; reason"


def test_the_page_says_a_findings_summary_from_its_verdict_and_a_root_causes_short_title(tmp_path):
    from fuzzshard.findings.rootcause import load_root_causes
    from fuzzshard.report.page import html_page, summarize

    out = tmp_path / "soak"
    (out / "cells").mkdir(parents=True)
    (out / "findings").mkdir()
    lines = [_case(0, "new"), _case(10, "known", "Adam", "fused", target="fsdp2", ck="full", ck_world=2)]
    (out / "cells" / "e0c0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    finding = json.loads((KNOWN_DIR / "dtensor.parity.Adafactor.forloop.param.json").read_text())
    truth = finding["summary"]
    finding.update(signature=NEW_SIG, summary="parity: param of layers.9.weight after step 7 differs (stale)")
    finding.pop("root_cause")
    (out / "findings" / f"{NEW_SIG}.json").write_text(json.dumps(finding))
    s = summarize(out)
    assert [f["summary"] for f in s["findings"]] == [truth]  # the verdict's words, not the stored copy
    page = html_page(s, "t")
    assert "stale" not in page
    rc = load_root_causes()["dsd-full-load-refills-missing-keys"]
    assert rc.what and len(rc.title) <= 120
    from html import escape

    # the short title in the cell, the bug in full where the cell says more on hover
    assert f"title='{escape(rc.what, quote=True)}'>{escape(rc.title, quote=True)}</td>" in page, page[-3000:]


def test_report_reads_a_fuzz_sessions_out_too(tmp_path):
    """A fuzz session logs a line per case in OUT/cells/fuzz.jsonl and writes its findings into OUT itself."""
    from fuzzshard.report.page import summarize, text

    (tmp_path / "cells").mkdir()
    lines = [_case(0, "pass", "Adam", "foreach"), _case(10, "new", "SGD", "forloop")]
    (tmp_path / "cells" / "fuzz.jsonl").write_text("".join(json.dumps(c) + "\n" for c in lines))
    (tmp_path / "dtensor.parity.grad.json").write_text(json.dumps({"signature": "dtensor.parity.grad"}))
    s = summarize(tmp_path)
    assert s["cases"] == 2 and [f["signature"] for f in s["findings"]] == ["dtensor.parity.grad"]
    assert "training loop" in text(s)
