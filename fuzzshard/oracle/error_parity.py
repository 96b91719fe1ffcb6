"""The error-parity oracle: only the sharded run raises, where the unsharded
reference trains on the same model and data. The bug is the message
template, not which optimizer, op or parameter surfaced it."""
from __future__ import annotations

import hashlib
import re

from . import Oracle
from .common import plain_trace, short
from .source import frame_source, innermost
from ..verdict import ErrorRecord, Verdict

# DTensor's refusal of an op it has no sharding strategy for: a gap of that op alone, so the op is part
# of the name (elsewhere the op in a message varies per case: the template is the bug)
_NO_STRATEGY = re.compile(r"Operator aten\.(\w+)(?:\.\w+)? does not have a sharding strategy registered")


def missing_strategy_op(message: str) -> str | None:
    """The op DTensor says it has no sharding strategy for ("_fused_sgd_"), if that is what ``message`` says."""
    m = _NO_STRATEGY.search(message or "")
    return m.group(1) if m else None


def signature(case, verdict: Verdict) -> str:
    """The root cause is the message template, not which optimizer or op surfaced it
    (but a missing sharding strategy names its op)."""
    err = verdict.error_record
    phase = err.extra.get("stage") or _phase_kind(err.phase or "")  # (records older than "stage")
    digest = message_digest(err.message, names=phase in ("save", "load"))
    op = missing_strategy_op(err.message)
    return f"{case.target}.error.{phase}.{err.type or 'Error'}.{digest}" + (f".{op}" if op else "")


def summary(verdict: Verdict) -> str:
    err = verdict.error_record
    return f"error parity: only the sharded run raises, in {err.phase}: {err.type}: {err.message}"


def address(case, verdict: Verdict) -> str:
    """The exception type and the innermost torch frame that made it. A missing sharding strategy is
    one family whatever the op and wherever a release checks it: the op is its detail (rootcause.detail)."""
    err = verdict.error_record
    if missing_strategy_op(err.message):
        return f"raises {err.type or 'Error'}: DTensor has no sharding strategy for an op (missing sharding strategy)"
    return f"raises {err.type or 'Error'} in {innermost(err.traceback or '')}"


def _phase(err: ErrorRecord) -> str:
    """Where it raised, as a user's loop names it ("optimizer.step", "forward/backward", "checkpoint load")."""
    return re.sub(r"^step \d+: ", "", err.phase or "training")


def title(case, verdict: Verdict) -> str:
    err = verdict.error_record
    return f"{err.type or 'error'} in {_phase(err)} where the unsharded model trains: {short(err.message, 90)}"


def _checked(err: ErrorRecord) -> bool:
    """Whether the harness raised it: a check of torch's result (replicas that differ, params lost), not torch's error."""
    return bool(re.search(rf"fuzzshard\.[\w.]+\.{re.escape(err.type or '?')}\b", err.traceback or ""))


def what(case, verdict: Verdict) -> str:
    err = verdict.error_record
    if _checked(err):
        return f"In the sharded run's {_phase(err)}, {short(err.message, 300)}; without sharding, the same model trains normally."
    return f"The sharded run raises `{err.type or 'an error'}` in {_phase(err)}, where the same model trains without sharding."


def expected(case, verdict: Verdict) -> str:
    return "the sharded model trains, as the same model does without sharding"


def expected_actual(verdict: Verdict) -> list[str]:
    """The exception, and the traceback's tail folded."""
    err = verdict.error_record
    tb = plain_trace(err.traceback or "").strip().splitlines()
    return ["**Expected**: the sharded model trains, as the same model does without sharding; " +
            (f"**actual**: {short(err.message, 300)} in {_phase(err)}." if _checked(err) else
             f"**actual**: `{err.type}: {short(err.message, 300)}` in {_phase(err)}."), "",
            "<details><summary>traceback</summary>", "", "```", "\n".join(tb[-30:]), "```", "</details>", ""]


def _phase_kind(phase: str) -> str:
    for key, kind in (("checkpoint save", "save"), ("checkpoint load", "load"), ("optimizer.step", "step"), ("constructor", "ctor"), ("forward", "fwdbwd"), ("shard", "shard")):
        if key in phase:
            return kind
    return "other"


def message_digest(message: str, names: bool = False) -> str:
    """Same message template -> same digest: op names, numbers and placements
    vary per case; ``names``: so do quoted strings and dotted keys
    (``optim.state.layers.0.bias.step``), as in state-dict messages."""
    # DTensor's "Sharding propagation failed for Op(op=aten.X, args_schema=...)" dumps the call: its specs,
    # shapes and a mask DTensor's values vary per case (and per release's printing); the op stays, it names the gap
    message = re.sub(r"Op\(op=aten\.(\w+)[^\n]*", r"op \1", message)
    template = re.sub(r"aten(\.|::)[\w.]+", "OP", message)  # aten::X: 2.10's C++ messages ("found no DeviceMesh ...")
    # a list of FQNs (cut short or not) and an FQN opening the message vary per case
    template = re.sub(r"\[\s*'[^\]]*(\]\.?|$)", "[NAMES]", template)
    template = re.sub(r"^\w+(\.\w+)+ (?=is not in)", "NAME ", template)
    if names:
        template = re.sub(r"'[^']*'|\b\w+(\.\w+)+", "NAME", template)
    template = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "()", template)
    # a number printed in exponent form is the same number template as a decimal one ("max abs diff 2.89e-06"
    # and "0.00067" are one message): else one bug's signature hangs on its magnitude
    template = re.sub(r"\d+(\.\d+)?[eE][-+]?\d+", "0.0", template)
    template = re.sub(r"\d+", "N", template)[:160]
    return hashlib.sha1(template.encode()).hexdigest()[:8]


ORACLE = Oracle("error_parity", "raises", signature, summary, address, title, expected_actual,
                lambda case, v: frame_source(v), what, expected, raised=True)
