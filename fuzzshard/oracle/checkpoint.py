"""The checkpoint oracle: what a save (full, sharded, through DCP or
torch.save, at one world size or another) stored does not come back from the
load, or the loaded run does not train on like the saved one (a silent bug)."""
from __future__ import annotations

from . import Oracle
from .source import frame_source


def signature(case, verdict: dict) -> str:
    """What did not survive which kind of round trip."""
    quantity = verdict["first"]["quantity"]
    if ".param_groups" in quantity:
        # which hyperparameter shows first is incidental; an empty group is part of the address
        quantity = quantity.split(".param_groups")[0] + ".group"
        if any(not g.params for g in case.groups):
            quantity += ".empty_group"
    return f"{case.target}.checkpoint.{case.checkpoint.kind}.{quantity}"


def summary(verdict: dict) -> str:
    m = verdict["first"]
    then = verdict.get("then") or {}  # an error the run met after the load: downstream of this divergence
    after = f"; then {then.get('phase')} raised {then.get('type')}: {then.get('message')}" if then else ""
    return (f"checkpoint round trip: {m['quantity']} of {m['fqn'] or 'the optimizer'} (saved after step {m['step']}) "
            f"differs: {m['detail']}; {verdict['count']} mismatches in all{after}")


def address(case, verdict: dict) -> str:
    """The state-dict API family (every DCP state_dict kind is one) and what did not survive."""
    kind = case.checkpoint.kind if case.checkpoint else "?"
    from ..kernel.state_io import STATE_DICT_KINDS  # the kinds that go through DCP's state_dict API

    family = "state-dict API" if kind in STATE_DICT_KINDS else kind
    return f"checkpoint through {family}: {signature(case, verdict).split(f'.checkpoint.{kind}.', 1)[-1]}"


def title(case, verdict: dict) -> str:
    first = verdict.get("first") or {}
    kind = case.checkpoint.kind if case.checkpoint else "?"
    return f"{kind} checkpoint round trip: {first.get('quantity', '?')} of {first.get('fqn', '?')}"


def expected_actual(verdict: dict) -> list[str]:
    rows = ["**Expected**: what was saved is what a load gives back (and a load trains on like the saved run); "
            "**actual**:", ""]
    rows += [f"- {m.get('quantity')} of `{m.get('fqn')}` (saved after step {m.get('step')}): {m.get('detail')}"
             for m in verdict.get("mismatches", [])[:6]]
    return rows + [""]


ORACLE = Oracle("checkpoint", "silent (checkpoint)", signature, summary, address, title, expected_actual,
                lambda case, v: frame_source(v))
