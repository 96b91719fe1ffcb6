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
Where several root causes share an address, the case decides: a wrapper's own
bug is no other target's, then the features their known findings share with
it (the message template, a missing strategy's op, the torch code that called
it). An address that names no code of the bug (no torch frame, or a dispatch point
such as DTensor's ``__torch_dispatch__``, where every DTensor op raises) matches
only with the same message template or a known finding's ``only_when``. A new *error* whose address comes down to one root cause so is that bug
in a face not recorded: a known hit (``Matcher.known_hit``), not a finding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import oracle
from .record import KNOWN_DIR, ROOT_CAUSES, Finding, compiled_tag
from ..oracle.error_parity import message_digest, missing_strategy_op
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
    fixed_in: str = ""  # the first release where it no longer shows (`fuzzshard bisect` records it; "" not known)

    def fixed_after(self, torch_version: str) -> str:
        """"fixed in torch X" where ``torch_version`` is a release older than the recorded fix, else ""."""
        from .releases import release_key, release_of

        made = release_of(torch_version or "")
        if not self.fixed_in or not made or release_key(made) >= release_key(self.fixed_in):
            return ""
        return f"fixed in torch {self.fixed_in}"

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


def load_root_causes(known: dict[str, Finding] | None = None, known_dir=KNOWN_DIR) -> dict[str, RootCause]:
    """id -> RootCause, each with the known signatures behind it (sorted)."""
    path = known_dir / ROOT_CAUSES
    data = json.loads(path.read_text()) if path.exists() else {}
    causes = {rid: RootCause(rid, d.get("title", ""), d.get("kind", ""), d.get("api", ""), d.get("upstream", {}),
                             d.get("minimal"), component=d.get("component", ""),
                             what=d.get("what", ""), fixed_in=d.get("fixed_in", "")) for rid, d in data.items()}
    for sig, f in sorted((known or {}).items()):
        if f.root_cause:
            causes.setdefault(f.root_cause, RootCause(f.root_cause, "(not described in root_causes.json)"))
            causes[f.root_cause].signatures.append(sig)
    return causes


# a root cause whose component is a wrapper is a bug of the targets that run it, and of no other
_WRAPPER_TARGETS = {"FSDP1": ("fsdp1",), "FSDP2": ("fsdp2", "parallelize"), "ZeRO": ("zero",)}


def _known_as(target: str) -> tuple[str, ...]:
    """``target`` and the built-in targets whose known bugs are its too (Target.known_as)."""
    from .. import targets

    return (target, *(getattr(targets.get(target), "known_as", ()) if target in targets.names() else ()))


# a step's param group that lacks a hyperparameter the reference's has ("None vs reference False"): whatever owns
# the groups dropped it (ZeRO's add_param_group), not the step's code; which key shows first is only the optimizer's
# first key in sorted order (Adam's amsgrad, SGD's dampening, Adagrad's differentiable), so the key is no address
LACKS_HPARAM = "param group: a hyperparameter the sharded run's group lacks"


def lacks_hyperparameter(verdict: Verdict) -> bool:
    """Whether a step divergence is a param group hyperparameter the sharded run's group has not (None there, a
    value in the reference's)."""
    first = verdict.first
    return bool(first is not None and first.quantity.startswith("param_groups.") and first.detail.startswith("None vs reference ")
                and first.detail != "None vs reference None")


def address(case, verdict: Verdict) -> str:
    """What identifies the bug behind a finding, whatever surfaced it (a
    compiled run's, with what ran compiled: compile's bugs are its own)."""
    where = oracle.of(verdict).address(case, verdict)  # each oracle's module says what identifies its bugs
    if lacks_hyperparameter(verdict):
        where = LACKS_HPARAM
    tag = compiled_tag(case)
    return f"{tag}: {where}" if tag else where


def detail(case, verdict: Verdict) -> str:
    """What an address leaves out and a summary still names: a missing sharding strategy's op."""
    op = missing_strategy_op(verdict.error_record.message) if oracle.raised(verdict) else None
    return f"aten.{op}" if op else ""


def template(case, verdict: Verdict) -> str:
    """An error's message template (its signature's digest, whatever the phase), "" for other findings."""
    return message_digest(verdict.error_record.message, names=True) if oracle.raised(verdict) else ""


def caller(case, verdict: Verdict) -> str:
    """The torch package whose code called into DTensor when it raised ("torch/optim": an optimizer's
    step, in a load's init step too), "" where the call came from outside torch (a model's own forward)."""
    if not oracle.raised(verdict):
        return ""
    outside = [f for f in torch_frames(verdict.error_record.traceback or "") if not f[0].startswith("distributed/tensor/")]
    made = telling_frame(outside)
    return ("torch/" + made[0].rsplit("/", 1)[0] if "/" in made[0] else "torch") if made else ""


# what tells root causes at one address apart, in this order: each narrows only where some of them share it
_FEATURES = (template, detail, caller)
# an address that names no torch code says little: there only the same message template makes a known hit
_NO_CODE = ("(no torch frame)", "(no telling frame)")
# nor does a dispatch point: DTensor's ``_api.py:__torch_dispatch__`` is where every DTensor op raises whatever went
# wrong (a strategy that kept a sharded weight, a plain tensor met in a recompute, a mask DTensor refuses), and
# checkpoint's ``__torch_dispatch__`` every op under selective AC: on torch 2.9.1 two of three new signatures matched
# by that address alone were other bugs than its one root cause (leads/2026-12-02-moe-10min)
_DISPATCH_POINTS = ("__torch_dispatch__", "__torch_function__")


def uninformative(where: str) -> bool:
    """Whether an address names no code of the bug (no torch frame, or a tensor subclass's dispatch point): a
    known finding there is the case's root cause only with the same message template, or where the known finding
    is known only under conditions (``only_when``) that hold for the case."""
    return any(no in where for no in _NO_CODE) or where.rsplit(":", 1)[-1] in _DISPATCH_POINTS


@dataclass(frozen=True)
class KnownHit:
    """A new finding that is a known root cause in a face not recorded: the same address, one root cause."""
    root_cause: str
    address: str
    detail: str = ""  # a missing strategy's op
    named: bool = True  # whether the root cause's known findings name that op
    by_message: bool = False  # the address names no torch code: the same message template made it one

    @property
    def text(self) -> str:
        """What a summary says of it: "aten._foreach_lerp_, an op the root cause does not name"."""
        if self.detail:
            return self.detail + ("" if self.named else ", an op the root cause does not name")
        return self.address + (", with the same message" if self.by_message else "")


class Matcher:
    """Known root causes by address: ``suspects(case, verdict)`` -> the ids
    of the root causes of known findings with the same address."""

    def __init__(self, known: dict[str, Finding]):
        self.causes = load_root_causes(known)
        self.by_address: dict[str, dict[str, list]] = {}  # address -> root cause -> its known findings there
        for f in known.values():
            if f.root_cause and f.verdict:
                self.by_address.setdefault(address(f.case, f.verdict), {}).setdefault(f.root_cause, []).append(f)

    def _runs_on(self, rid: str, target: str) -> bool:
        """Whether root cause ``rid`` can be a bug of ``target``: a wrapper's own is its targets' alone."""
        component = self.causes[rid].component if rid in self.causes else ""
        return target in _WRAPPER_TARGETS.get(component, (target,))

    def _found(self, case, verdict: Verdict) -> dict[str, list]:
        """Root cause -> its known findings at this case's address that may be this case's: a known finding
        known only where its conditions hold (``only_when``: pp.parity.grad's split backward without a weight
        path, a tensor lr under ReduceLROnPlateau) is none of a case they do not hold for."""
        from .record import _holds

        where = address(case, verdict)
        found = self.by_address.get(where, {})
        mine = {rid: [f for f in fs if not f.only_when or _holds(case, f.only_when)] for rid, fs in found.items()}
        if uninformative(where):  # the address alone says nothing: the message, or a condition met, must agree
            said = template(case, verdict)
            mine = {rid: [f for f in fs if f.only_when or template(f.case, f.verdict) == said]
                    for rid, fs in mine.items()}
        return {rid: fs for rid, fs in mine.items() if fs}

    def suspects(self, case, verdict: Verdict) -> list[str]:
        """Where several root causes share the address, one that is a bug of
        another target's own wrapper (an FSDP1 FlatParameter bug for a dtensor
        case) is left out: "loaded.state.step" is both DSD's frozen-param bug
        and FSDP1's shared 0-d step, and a dtensor finding can be only the first.
        Then the case's features decide (``_FEATURES``): fsdp2's "no torch frame"
        RuntimeError is DTensor's two-mesh foreach bug by its message, not the
        Conv one; a missing strategy met in torch/optim is the optimizer-ops
        family, not CPU SDPA's."""
        found = self._found(case, verdict)
        ids = sorted(found)
        mine = [rid for rid in ids if self._runs_on(rid, case.target)]
        if len(ids) > 1:
            ids = mine or ids
        elif not oracle.raised(verdict):
            # a divergence's address says where it showed (an optimizer's implementation, every target's): a
            # wrapper's own bug known there (FSDP1's shared 0-d step, in each optimizer's face) is no suspect elsewhere
            ids = mine
        for feature in _FEATURES:
            mine = feature(case, verdict) if len(ids) > 1 else ""
            if mine:
                ids = [rid for rid in ids if any(feature(f.case, f.verdict) == mine for f in found[rid])] or ids
        return ids

    def known_hit(self, case, verdict: Verdict) -> KnownHit | None:
        """The known root cause a new error is by its address, or None (a new
        finding, "probably" at most). Only an error's address (its exception
        type and the torch code that made it) and a localized divergence's (the
        module whose forward or backward made it: kernel/localize.py names the
        first whose output differs from the reference's or between ranks) and a
        param group's missing hyperparameter's (what owns the groups dropped it;
        ``LACKS_HPARAM``) say what made it; another divergence's says where it
        showed (a step's optimizer, a checkpoint's API), so it stays new. One root cause must be left, one
        that runs on this target and was seen on this device; where the address
        names no code of the bug (no torch frame, a dispatch point: ``uninformative``),
        with the same message template or a known finding's ``only_when`` that holds; a missing strategy
        for an op it does not name, only where torch called that op from the
        same package as in its known findings (the optimizers', whatever op)."""
        localized = oracle.of(verdict).localized
        if not oracle.raised(verdict) and not (localized and localized(verdict)) and not lacks_hyperparameter(verdict):
            return None
        where = address(case, verdict)
        ids = self.suspects(case, verdict)
        if len(ids) != 1 or not self._runs_on(ids[0], case.target):
            return None
        theirs = [f for f in self._found(case, verdict)[ids[0]] if not f.devices or case.device in f.devices]
        if localized:  # one module runs other code under another target (fsdp2's plain activations): that target's own
            theirs = [f for f in theirs if f.case.target in _known_as(case.target)]
        if not theirs:
            return None
        weak = uninformative(where)  # (_found kept only the known findings whose message or conditions agree)
        op = detail(case, verdict)
        named = op in {detail(f.case, f.verdict) for f in theirs}
        if op and not named and (not caller(case, verdict) or
                                 caller(case, verdict) not in {caller(f.case, f.verdict) for f in theirs}):
            return None
        return KnownHit(ids[0], where, op, named or not op,
                        weak and template(case, verdict) in {template(f.case, f.verdict) for f in theirs})

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
