"""Typed verdicts read every recorded verdict and write it back unchanged."""
import json

import pytest

from fuzzshard.findings.record import KNOWN_DIR
from fuzzshard.verdict import ErrorRecord, Mismatch, Status, Verdict

KNOWN = sorted(p for p in KNOWN_DIR.glob("*.json") if p.name != "root_causes.json")


@pytest.mark.parametrize("path", KNOWN, ids=[p.stem for p in KNOWN])
def test_every_known_verdict_round_trips_through_the_types(path):
    d = json.loads(path.read_text())["verdict"]
    v = Verdict.from_dict(d)
    assert v.to_dict() == d
    assert v.is_finding and v.oracle == d["oracle"]
    if "first" in d:
        assert isinstance(v.first, Mismatch) and v.first.fqn == d["first"]["fqn"] and v.first.step == d["first"]["step"]
        assert all(isinstance(m, Mismatch) for m in v.mismatches)
    if isinstance(d.get("error"), dict):
        assert isinstance(v.error, ErrorRecord) and v.error.type == d["error"]["type"]


def test_a_verdict_without_a_known_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Verdict.from_dict({"status": "maybe"})
    with pytest.raises(ValueError, match="maybe"):
        Verdict("maybe")
    assert Verdict.from_dict({"status": "error", "error": "rank 0 returned no verdict"}).error == "rank 0 returned no verdict"


def test_a_field_set_after_the_read_is_written_and_the_helpers_read_what_is_there():
    """The runner names the rank of a verdict it read; oracles read an error record and the first
    quantity whatever the verdict holds."""
    from dataclasses import replace

    from fuzzshard.verdict import finding

    v = Verdict.from_dict({"status": "error", "error": "boom"})
    assert replace(v, rank=2).to_dict() == {"status": "error", "error": "boom", "rank": 2}
    assert v.error_record == ErrorRecord("", "") and v.quantity == ""
    parity = Verdict.from_dict(finding("parity", [Mismatch("grad", "w", 0, "d").to_dict()]))
    assert parity.quantity == "grad" and parity.error_record.type == ""
    raised = Verdict.from_dict(finding("error_parity", error=ErrorRecord("KeyError", "k").to_dict()))
    assert raised.error_record.type == "KeyError" and raised.quantity == ""


def test_the_status_is_an_enum_that_reads_and_writes_as_its_string():
    """Verdict.status is a Status whichever way it came (a string, a member, a file), and is still its
    string to JSON, to string comparisons and to lookups keyed by the string."""
    d = {"status": "finding", "oracle": "parity"}
    v = Verdict.from_dict(d)
    assert v.status is Status.FINDING and Verdict("finding").status is Status.FINDING and v.is_finding
    assert v.status == "finding" and {"finding": 1}.get(v.status) == 1 and f"{v.status}" == "finding"
    assert json.dumps(v.to_dict()) == json.dumps(d) and json.loads(json.dumps(v.to_dict())) == d
    assert [s.value for s in Status] == ["pass", "finding", "invalid", "error"]
