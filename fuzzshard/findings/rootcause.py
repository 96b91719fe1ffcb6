"""Root causes: the known findings grouped by the torch bug behind them, and a
new finding matched against them.

A signature names a finding (target, oracle, optimizer, quantity, ...); one
torch bug often shows under many (every optimizer x implementation it touches,
every checkpoint kind). known/root_causes.json names the bugs: an id, one
line, the API suspected, the upstream state (an issue or PR and its state,
"by-design" with the reason, or "not-reported") and a hand-reduced script
where there is one. Each known finding says which root cause it is.

A new finding is matched by its *address*, what identifies a bug and not the
finding: the innermost telling torch frame of an error, where a crash or a
hang happened, the module of a localized divergence, the implementation (or
the optimizer) of a step divergence, the state-dict API family and quantity
of a checkpoint mismatch (each oracle's module in oracle/ says its own). A
new finding whose address a known finding has is "probably" that finding's
root cause; new findings with one address are grouped as one suspected bug.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import oracle
from .record import KNOWN_DIR, ROOT_CAUSES, Finding, compiled_tag
# reading where a traceback points is the oracles' (their addresses use it); still importable from here
from ..oracle.source import telling_frame, torch_frames  # noqa: F401
from ..verdict import Verdict


@dataclass
class RootCause:
    id: str
    title: str
    kind: str = ""
    api: str = ""
    upstream: dict = field(default_factory=dict)  # state (open, closed, by-design, not-reported), ref, note
    minimal: str | None = None  # a hand-reduced standalone script, relative to the repository
    signatures: list = field(default_factory=list)  # the known findings it is behind
    component: str = ""  # as PyTorch's issue titles name it: DTensor, FSDP2, DSD, torch.optim, ...
    what: str = ""  # the bug said in full, where the title (<= 120 characters, an issue's title) is short of it

    @property
    def upstream_text(self) -> str:
        """"pytorch/pytorch#153350 (open)", "by design: ...", "not reported"."""
        up = self.upstream or {}
        state = up.get("state", "not-reported")
        if state == "by-design":
            return f"by design{': ' + up['note'] if up.get('note') else ''}"
        if up.get("ref"):
            return f"{up['ref']} ({state})"
        return state.replace("-", " ")


def load_root_causes(known: dict[str, Finding] | None = None) -> dict[str, RootCause]:
    """id -> RootCause, each with the known signatures behind it (sorted)."""
    path = KNOWN_DIR / ROOT_CAUSES
    data = json.loads(path.read_text()) if path.exists() else {}
    causes = {rid: RootCause(rid, d.get("title", ""), d.get("kind", ""), d.get("api", ""), d.get("upstream", {}),
                             d.get("minimal"), component=d.get("component", ""),
                             what=d.get("what", "")) for rid, d in data.items()}
    for sig, f in sorted((known or {}).items()):
        if f.root_cause:
            causes.setdefault(f.root_cause, RootCause(f.root_cause, "(not described in root_causes.json)"))
            causes[f.root_cause].signatures.append(sig)
    return causes


# a root cause whose component is a wrapper is a bug of the targets that run it, and of no other
_WRAPPER_TARGETS = {"FSDP1": ("fsdp1",), "FSDP2": ("fsdp2", "parallelize"), "ZeRO": ("zero",)}


def address(case, verdict: Verdict) -> str:
    """What identifies the bug behind a finding, whatever surfaced it (a
    compiled run's, with what ran compiled: compile's bugs are its own)."""
    where = oracle.of(verdict).address(case, verdict)  # each oracle's module says what identifies its bugs
    tag = compiled_tag(case)
    return f"{tag}: {where}" if tag else where


class Matcher:
    """Known root causes by address: ``suspects(case, verdict)`` -> the ids
    of the root causes of known findings with the same address."""

    def __init__(self, known: dict[str, Finding]):
        self.causes = load_root_causes(known)
        self.by_address: dict[str, set] = {}
        for f in known.values():
            if f.root_cause and f.verdict:
                self.by_address.setdefault(address(f.case, f.verdict), set()).add(f.root_cause)

    def suspects(self, case, verdict: Verdict) -> list[str]:
        """Where several root causes share the address, one that is a bug of
        another target's own wrapper (an FSDP1 FlatParameter bug for a dtensor
        case) is left out: "loaded.state.step" is both DSD's frozen-param bug
        and FSDP1's shared 0-d step, and a dtensor finding can be only the first."""
        ids = sorted(self.by_address.get(address(case, verdict), ()))
        if len(ids) > 1:
            own = [rid for rid in ids if case.target in _WRAPPER_TARGETS.get(
                self.causes[rid].component if rid in self.causes else "", (case.target,))]
            ids = own or ids
        return ids

    def label(self, case, verdict: Verdict) -> str:
        """"probably root cause X: title" or "" ."""
        ids = self.suspects(case, verdict)
        if not ids:
            return ""
        if len(ids) == 1:
            return f"probably root cause {ids[0]}: {self.causes[ids[0]].title}"
        return f"probably one of the root causes {', '.join(ids)}"

    def group(self, case, verdict: Verdict) -> str:
        """The key a session groups new findings by: the suspected root cause,
        else the address, with every step divergence one group: a bug in code
        the optimizers share (weight decay, a DTensor op they all call) shows
        as one finding per optimizer x implementation x quantity."""
        ids = self.suspects(case, verdict)
        if len(ids) == 1:
            return f"root cause {ids[0]} (probably)"
        where = address(case, verdict)
        return "new: optimizer step diverges" if where.startswith("optimizer step") else f"new: {where}"


def grouped(findings, matcher: Matcher) -> dict[str, list]:
    """Findings by suspected root cause (or address), in order of first appearance."""
    out: dict[str, list] = {}
    for f in findings:
        out.setdefault(matcher.group(f.case, f.verdict), []).append(f)
    return out
