"""The known list's files as a maintainer reads them: short root-cause titles, summaries that say their verdict."""
import json

from fuzzshard.findings.record import KNOWN_DIR, ROOT_CAUSES, load_finding, load_known, summary
from fuzzshard.findings.rootcause import load_root_causes

TITLE_LIMIT = 120  # an issue title (GitHub refuses one over 256; a reader takes in far fewer)


def test_every_root_cause_title_is_short():
    causes = load_root_causes()
    assert len(causes) > 50
    long = {rid: len(rc.title) for rid, rc in causes.items() if len(rc.title) > TITLE_LIMIT}
    assert not long, long


def test_a_cut_title_keeps_its_full_text_as_what():
    # what the title leaves out is in "what": a cut title is shorter than it and names the same API first
    data = json.loads((KNOWN_DIR / ROOT_CAUSES).read_text())
    cut = {rid: rc for rid, rc in data.items() if rc.get("what")}
    assert len(cut) >= 50
    for rid, rc in cut.items():
        assert len(rc["what"]) > len(rc["title"]), rid
    assert load_root_causes()["dsd-frozen-param-optim-state-dropped"].what.endswith("keyed on requires_grad)")


def test_no_known_finding_stores_a_summary_its_verdict_does_not_say():
    stale = []
    for path in sorted(KNOWN_DIR.glob("*.json")):
        if path.name == ROOT_CAUSES:
            continue
        stored = json.loads(path.read_text()).get("summary")
        finding = load_finding(path)
        if stored != summary(finding.verdict):
            stale.append(path.name)
    assert len(load_known()) > 150
    assert not stale, stale


def test_a_finding_summary_is_derived_from_its_verdict_not_the_stored_copy(tmp_path):
    path = sorted(p for p in KNOWN_DIR.glob("dtensor.parity.*.json"))[0]
    data = json.loads(path.read_text())
    truth = data["summary"]
    data["summary"] = "parity: param of another.weight after step 9 differs (a stale copy)"
    (tmp_path / path.name).write_text(json.dumps(data))
    finding = load_finding(tmp_path / path.name)
    assert finding.summary == truth
    assert finding.to_dict()["summary"] == truth


def test_show_names_the_root_cause_by_its_short_title_and_the_known_table_says_it_in_full():
    from fuzzshard.cli.known import known_markdown
    from fuzzshard.report.show import render

    rc = load_root_causes()["dsd-frozen-param-optim-state-dropped"]
    shown = render(load_finding(KNOWN_DIR / "dtensor.checkpoint.broadcast.loaded.state.missing.json"))
    assert f"root cause dsd-frozen-param-optim-state-dropped: {rc.title} [pytorch/pytorch#192202 (open)]" in shown
    assert rc.what not in shown
    row = next(ln for ln in known_markdown(load_known()).splitlines()
               if ln.startswith("| `dsd-frozen-param-optim-state-dropped` |"))
    assert f"| {rc.what.replace('|', '/')}." in row, row  # the "what" column: the bug in full


def test_a_known_files_name_is_its_signature_or_one_suffixed_and_those_sharing_one_have_conditions():
    # several root causes under one signature: <sig>.json, <sig>.<suffix>.json, each with an only_when (without
    # one the first would hide the others) that holds for its own case
    from fuzzshard.findings.record import known_signature

    known, by_sig = load_known(), {}
    for name, f in known.items():
        assert name == f.signature or name.startswith(f.signature + "."), name
        by_sig.setdefault(f.signature, []).append(name)
    shared = {sig: names for sig, names in by_sig.items() if len(names) > 1}
    assert len(shared) >= 2
    for sig, names in shared.items():
        for name in names:
            assert known[name].only_when and known_signature(sig, known[name].case, known) == name, name
