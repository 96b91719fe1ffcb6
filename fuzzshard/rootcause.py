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
of a checkpoint mismatch. A new finding whose address a known finding has is
"probably" that finding's root cause; new findings with one address are
grouped as one suspected bug.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .findings import KNOWN_DIR, ROOT_CAUSES, Finding, compiled_tag, missing_strategy_op, signature

# frames that pass an error along rather than make it: the address is the innermost frame that is not one
_PASSING = ("_ops.py", "nn/modules/module.py", "autograd/graph.py", "autograd/__init__.py", "_tensor.py",
            "utils/_stats.py", "utils/_contextlib.py", "_compile.py", "_dynamo/", "__init__.py",
            "distributed/utils.py", "distributed/tensor/_dispatch.py", "optim/optimizer.py")
# a traceback's frame line ("line N, in f") and faulthandler's ("line N in f")
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


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
                             d.get("minimal"), component=d.get("component", "")) for rid, d in data.items()}
    for sig, f in sorted((known or {}).items()):
        if f.root_cause:
            causes.setdefault(f.root_cause, RootCause(f.root_cause, "(not described in root_causes.json)"))
            causes[f.root_cause].signatures.append(sig)
    return causes


def address(case, verdict: dict) -> str:
    """What identifies the bug behind a finding, whatever surfaced it (a
    compiled run's, with what ran compiled: compile's bugs are its own)."""
    tag = compiled_tag(case)
    return f"{tag}: {_address(case, verdict)}" if tag else _address(case, verdict)


def _address(case, verdict: dict) -> str:
    oracle = verdict.get("oracle", "")
    err = verdict.get("error") if isinstance(verdict.get("error"), dict) else {}
    if oracle == "error_parity":
        op = missing_strategy_op(err.get("message", ""))  # a missing sharding strategy: the op is the bug
        return f"raises {err.get('type', 'Error')} in {_innermost(err.get('traceback', ''))}" + \
            (f" (no sharding strategy for aten.{op})" if op else "")
    if oracle in ("crash", "hang"):
        where = verdict.get("where") or {}
        return f"{oracle} ({err.get('type', '?')}) at {where[min(where)] if where else 'an unknown place'}"
    if oracle == "checkpoint":
        kind = case.checkpoint.kind if case.checkpoint else "?"
        from .kernel.state_io import STATE_DICT_KINDS  # the kinds that go through DCP's state_dict API

        family = "state-dict API" if kind in STATE_DICT_KINDS else kind
        return f"checkpoint through {family}: {signature(case, verdict).split(f'.checkpoint.{kind}.', 1)[-1]}"
    if oracle == "parity":
        first = verdict.get("first") or {}
        quantity = first.get("quantity", "")
        if quantity in ("forward", "backward"):
            return f"{quantity} of {first.get('module', '?')}"
        if quantity in ("loss", "grad"):
            return quantity + (f" {first['presence']}" if "presence" in first else "")
        kw = case.optim.kwargs  # a fused kernel is shared by its optimizers; elsewhere the optimizer is the code
        if kw.get("fused"):
            return "optimizer step: fused kernel" + (", non-contiguous grad" if first.get("grad") == "non-contiguous" else "")
        return f"optimizer step: {case.optim.name}"
    return oracle or "?"


def torch_frames(text: str, innermost_first: bool = False) -> list[tuple[str, int, str]]:
    """The torch frames of a traceback (or of a faulthandler dump: ``innermost_first``),
    innermost first, as (path under torch/, line, function)."""
    frames = [(p, int(line), fn) for p, line, fn in _FRAME.findall(text or "") if "/torch/" in p]
    frames = frames if innermost_first else frames[::-1]
    return [(p.split("site-packages/torch/", 1)[1] if "site-packages/torch/" in p else p.rsplit("/torch/", 1)[1],
             line, fn) for p, line, fn in frames]


def telling_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost of ``frames`` that makes an error rather than passes one along."""
    return next((f for f in frames if not any(f[0] == g or f[0].startswith(g) or f[0].endswith("/" + g)
                                              for g in _PASSING)), None)


def _innermost(traceback_text: str) -> str:
    """The innermost torch frame that makes an error, as "torch/PATH:function"."""
    frames = torch_frames(traceback_text)
    made = telling_frame(frames)
    if made:
        return f"torch/{made[0]}:{made[2]}"
    return "torch (no telling frame)" if frames else "fuzzshard or the test (no torch frame)"


class Matcher:
    """Known root causes by address: ``suspects(case, verdict)`` -> the ids
    of the root causes of known findings with the same address."""

    def __init__(self, known: dict[str, Finding]):
        self.causes = load_root_causes(known)
        self.by_address: dict[str, set] = {}
        for f in known.values():
            if f.root_cause and f.verdict:
                self.by_address.setdefault(address(f.case, f.verdict), set()).add(f.root_cause)

    def suspects(self, case, verdict: dict) -> list[str]:
        return sorted(self.by_address.get(address(case, verdict), ()))

    def label(self, case, verdict: dict) -> str:
        """"probably root cause X: title" or "" ."""
        ids = self.suspects(case, verdict)
        if not ids:
            return ""
        if len(ids) == 1:
            return f"probably root cause {ids[0]}: {self.causes[ids[0]].title}"
        return f"probably one of the root causes {', '.join(ids)}"

    def group(self, case, verdict: dict) -> str:
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
