"""A dispatch point names no code of a bug: DTensor's ``_api.py:__torch_dispatch__`` is where every DTensor op
raises, whatever went wrong. A 2.9.1 session (leads/2026-12-02-moe-10min) matched three new signatures to Rprop's
bool-mask root cause by that address alone, two of them wrongly (a LayerNorm backward strategy, an FSDP2 recompute).
There a known finding is the case's root cause only with the same message template (or an ``only_when`` that
holds): the two are no Rprop face, each is its own root cause by its message, and Rprop's 2.9.1 face still is Rprop's."""
from fuzzshard.findings.record import load_known
from fuzzshard.findings.rootcause import Matcher, address, uninformative

DISPATCH = "raises RuntimeError in torch/distributed/tensor/_api.py:__torch_dispatch__"
RPROP = "rprop-forloop-bool-mask-inplace-on-shard"
MISATTRIBUTED = {"dtensor.error.fwdbwd.RuntimeError.2ce71b89": "dtensor-layer-norm-backward-keeps-sharded-weight",
                 "fsdp2.error.fwdbwd.RuntimeError.16a65899": "fsdp2-ac-nested-unit-twice-recompute-sharded"}


def test_a_dispatch_point_alone_matches_no_root_cause():
    known = load_known()
    matcher = Matcher({s: f for s, f in known.items() if s not in MISATTRIBUTED})  # as the 2.9.1 session knew them
    assert RPROP in matcher.by_address[DISPATCH]  # Rprop's 2.9.1 face raises at the dispatch point too
    for sig in MISATTRIBUTED:
        f = known[sig]
        assert address(f.case, f.verdict) == DISPATCH and uninformative(DISPATCH)
        assert matcher.suspects(f.case, f.verdict) == [] and matcher.known_hit(f.case, f.verdict) is None
        assert matcher.label(f.case, f.verdict) == "" and matcher.group(f.case, f.verdict) == f"new: {DISPATCH}"
    everything = Matcher(known)  # recorded, each is its own root cause: by its message, not by the address
    for sig, rid in MISATTRIBUTED.items():
        hit = everything.known_hit(known[sig].case, known[sig].verdict)
        assert hit.root_cause == rid and hit.by_message


def test_a_dispatch_point_with_the_same_message_still_matches():
    """Rprop's bool mask on a Replicate DTensor (dtensor, 2.9.1) is its fsdp2 2.9.1 face's message at the same
    address: a known hit of Rprop's root cause, as the session read it."""
    known, sig = load_known(), "dtensor.error.step.RuntimeError.b27724f0"
    f = known[sig]
    matcher = Matcher({s: g for s, g in known.items() if s != sig})
    assert address(f.case, f.verdict) == DISPATCH
    assert matcher.suspects(f.case, f.verdict) == [RPROP]
    hit = matcher.known_hit(f.case, f.verdict)
    assert hit.root_cause == RPROP and hit.by_message and hit.address == DISPATCH


def test_only_addresses_that_name_no_code_of_the_bug_are_uninformative():
    assert uninformative("raises RuntimeError in torch/utils/checkpoint.py:__torch_dispatch__")
    assert uninformative("compiled inductor: raises RuntimeError in torch/distributed/tensor/_api.py:__torch_dispatch__")
    assert uninformative("raises RuntimeError in torch (no telling frame)")
    assert not uninformative("raises RuntimeError in torch/optim/rprop.py:_single_tensor_rprop")
    assert not uninformative("raises RuntimeError in torch/distributed/tensor/_api.py:redistribute")
