"""The replica oracle: ranks that hold copies of one replicated value (a
param, grad, optimizer state tensor or hyperparameter: a Replicate mesh dim,
HSDP's replicas, FSDP1's and ZeRO's whole params) hold different ones after a
step or a load (a silent bug, whatever the reporting rank's copy says)."""
from __future__ import annotations

from . import Oracle
from .common import num
from .source import frame_source
from ..verdict import Mismatch, Verdict


def _quantity(m: Mismatch) -> str:
    return m.quantity.replace("param_groups.", "group.")


def signature(case, verdict: Verdict) -> str:
    """What diverged names it (``fsdp2.replica.state.exp_avg_sq``); a copy one rank lacks is its own kind."""
    first = verdict.first
    presence = f".{first.extra['presence']}" if "presence" in first.extra else ""
    return f"{case.target}.replica.{_quantity(first)}{presence}"


def _ranks(m: Mismatch) -> str:
    """"ranks [0, 2] vs [1, 3]": who holds which copy."""
    classes = m.extra.get("replicas") or []
    return " vs ".join(str(c) for c in classes) if classes else f"rank {m.extra.get('rank', '?')}"


def summary(verdict: Verdict) -> str:
    m = verdict.first
    when = f"after the load at step {m.step}" if m.quantity.startswith("loaded.") else f"after step {m.step}"
    x = m.extra
    size = f" (max abs diff {x['max_abs']:.3g}, {x['bad']}/{x['numel']} elements)" if "max_abs" in x else ""
    return (f"replica: {m.quantity} of {m.fqn or 'the model'} {when} differs between ranks {_ranks(m)}: "
            f"{m.detail}{size}; {verdict.extra['count']} mismatches in all")


def address(case, verdict: Verdict) -> str:
    return f"replicas of {_quantity(verdict.first).split('.')[0] if verdict.first else '?'} differ"


def _thing(m: Mismatch) -> str:
    q = m.quantity.removeprefix("loaded.")
    if q.startswith("param_groups."):
        return f"`{q.split('.', 1)[1]}` of {m.fqn or 'a param group'}"
    if q.startswith("state."):
        return f"optimizer state `{q.split('.', 1)[1]}` of `{m.fqn}`"
    return f"{q} of `{m.fqn}`"


def title(case, verdict: Verdict) -> str:
    m = verdict.first
    return (f"replicas of {_thing(m).replace('`', '')} differ between ranks after "
            f"{'a checkpoint load' if m.quantity.startswith('loaded.') else f'step {m.step}'} "
            f"({case.optim.name}, {case.world_size} ranks)")


def what(case, verdict: Verdict) -> str:
    when = "a checkpoint load" if verdict.quantity.startswith("loaded.") else "a training step"
    return (f"No error is raised, but after {when} ranks that hold replicas of the same "
            f"{_thing(verdict.first).split(' of ')[0].replace('`', '')} hold different values.")


def expected(case, verdict: Verdict) -> str:
    return "every rank holding a replica of a value holds the same bits, as after an all-reduce or a broadcast"


def expected_actual(verdict: Verdict) -> list[str]:
    rows = ["**Expected**: every replica of a value is the same, bit for bit; **actual** (the first differences):", "",
            "| what | step | ranks (one copy each) | lowest rank's copy | differing copy | max abs diff | elements off |",
            "|---|---|---|---|---|---|---|"]
    for m in (verdict.mismatches or [])[:6]:
        x = m.extra
        off = f"{x['bad']}/{x['numel']}" if "bad" in x else ""
        want, got = (num(x.get("want")), num(x.get("got"))) if "max_abs" in x else ("", m.detail)
        rows.append(f"| {_thing(m)} | {m.step} | {_ranks(m)} | {want} | {got} | {num(x.get('max_abs', ''))} | {off} |")
    return rows + [""]


def script(case, verdict: Verdict, plan: dict) -> dict:
    """A straight-line script's plan (fuzzshard/scriptgen): the run up to the step (or the load) where the
    ranks' copies differ, every rank's copy of the quantity gathered and checked after each."""
    ck, q = case.checkpoint, verdict.first.quantity
    loaded = q.startswith("loaded.")
    k = ck.after if loaded else verdict.first.step
    if ck and (loaded or k > ck.after):
        plan.update(mode="replica", load_last=k)
    else:
        plan.update(mode="replica", last=k, load=False, ckpt=False)
    plan["quantity"] = q.removeprefix("loaded.")
    return plan


ORACLE = Oracle("replica", "silent", signature, summary, address, title, expected_actual,
                source=lambda case, v: frame_source(v), what=what, expected=expected, script=script)
