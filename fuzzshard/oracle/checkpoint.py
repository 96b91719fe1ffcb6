"""The checkpoint oracle: what a save (full, sharded, through DCP or
torch.save, at one world size or another) stored does not come back from the
load, or the loaded run does not train on like the saved one (a silent bug)."""
from __future__ import annotations

from . import Oracle
from .source import frame_source
from ..verdict import Verdict


def signature(case, verdict: Verdict) -> str:
    """What did not survive which kind of round trip."""
    quantity = verdict.first.quantity
    if ".param_groups" in quantity:
        # which hyperparameter shows first is incidental; an empty group is part of the address
        quantity = quantity.split(".param_groups")[0] + ".group"
        if any(not g.params for g in case.groups):
            quantity += ".empty_group"
    return f"{case.target}.checkpoint.{_kind_tag(case)}.{quantity}"


def _kind_tag(case) -> str:
    """The kind of round trip as a signature names it: an async DCP save is a code path of its own
    (its staging), so "dcp_async" (a blocking save's bug that shows either way is one finding: generalize)."""
    ck = case.checkpoint
    return f"{ck.kind}_async" if ck.async_save else ck.kind


def summary(verdict: Verdict) -> str:
    m = verdict.first
    then = verdict.extra.get("then") or {}  # an error the run met after the load: downstream of this divergence
    after = f"; then {then.get('phase')} raised {then.get('type')}: {then.get('message')}" if then else ""
    return (f"checkpoint round trip: {m.quantity} of {m.fqn or 'the optimizer'} (saved after step {m.step}) "
            f"differs: {m.detail}; {verdict.extra['count']} mismatches in all{after}")


def address(case, verdict: Verdict) -> str:
    """The state-dict API family (every DCP state_dict kind is one) and what did not survive."""
    kind = case.checkpoint.kind if case.checkpoint else "?"
    from ..kernel.state_io import STATE_DICT_KINDS  # the kinds that go through DCP's state_dict API

    family = "state-dict API" if kind in STATE_DICT_KINDS else kind
    family += " and async_save" if case.checkpoint and case.checkpoint.async_save else ""
    tag = _kind_tag(case) if case.checkpoint else kind
    return f"checkpoint through {family}: {signature(case, verdict).split(f'.checkpoint.{tag}.', 1)[-1]}"


# how a torch user names each kind of save and load (kernel/state_io.py's kinds)
_KINDS = {"full": "full state dict (get_/set_state_dict with full_state_dict=True)",
          "broadcast": "full state dict broadcast from rank 0 (broadcast_from_rank0=True)",
          "dcp": "torch.distributed.checkpoint (dcp.save / dcp.load)",
          "sharded": "sharded state dict (get_/set_state_dict)",
          "fsdp1_sharded": "FSDP sharded optimizer state dict",
          "fsdp1_legacy": "FSDP full_optim_state_dict"}


def _kind(case) -> str:
    kind = case.checkpoint.kind if case is not None and case.checkpoint else ""
    if kind == "dcp" and case.checkpoint.async_save:
        return "torch.distributed.checkpoint (dcp.async_save while training goes on / dcp.load)"
    return _KINDS.get(kind, f"{kind} checkpoint" if kind else "checkpoint")


def _thing(quantity: str) -> str:
    """What did not survive, as a torch user names it."""
    rest = quantity.split(".", 1)[1] if "." in quantity else quantity
    if rest == "param":
        return "the params"
    if rest.startswith("param_groups."):
        return f"the param groups' `{rest.split('.', 1)[1]}`"
    if rest == "state.extra":
        return "the optimizer state (the load adds state that was never saved)"
    if rest == "state.missing":
        return "the optimizer state (saved state is missing after the load)"
    if rest.startswith("state."):
        return f"the optimizer state `{rest.split('.', 1)[1]}`"
    if rest.startswith("optim.state."):
        return f"the saved optimizer state `{rest.rsplit('.', 1)[-1]}`"
    return f"`{rest}`"


def title(case, verdict: Verdict) -> str:
    quantity = verdict.quantity or "?"
    if quantity == "loaded.strict":
        return f"a strict load through the {_kind(case)} accepts a state dict with missing keys"
    return f"{_thing(quantity)} does not survive a save and load through the {_kind(case)}"


def what(case, verdict: Verdict) -> str:
    quantity = verdict.quantity or "?"
    if quantity == "loaded.strict":
        return (f"No error is raised: a strict load through the {_kind(case)} accepts a model state dict with "
                f"missing keys, which `load_state_dict(strict=True)` refuses.")
    if quantity.startswith("saved."):
        return (f"No error is raised, but what the {_kind(case)} saves of {_thing(quantity)} differs from the "
                f"optimizer's own `state_dict()`.")
    return f"No error is raised, but after a save and load through the {_kind(case)}, {_thing(quantity)} differs from what was saved."


def expected(case, verdict: Verdict) -> str:
    return "what is saved is what the load gives back, as `state_dict()` / `load_state_dict()` on the same model do"


def expected_actual(verdict: Verdict) -> list[str]:
    rows = ["**Expected**: what is saved is what the load gives back; **actual**:", ""]
    for m in (verdict.mismatches or [])[:6]:
        detail = str(m.detail).replace("reference", "unsharded")
        if m.quantity == "loaded.strict":  # the detail says it all
            rows.append(f"- {detail}")
            continue
        rows.append(f"- {_thing(m.quantity)}" + (f" of `{m.fqn}`" if m.fqn else "") + f" (saved after step {m.step}): {detail}")
    then = verdict.extra.get("then") or {}
    if then:
        rows.append(f"- then {then.get('phase')} raised `{then.get('type')}: {then.get('message')}`")
    return rows + [""]


def script(case, verdict: Verdict | None, plan: dict) -> dict:
    """A straight-line script's plan (fuzzshard/scriptgen): the state right before the save against the state
    right after the load, exactly; where a full save stored other values than the optimizer held ("saved"),
    the stored optimizer state against the optimizer's, with no load."""
    ck = case.checkpoint
    quantity = verdict.quantity if verdict else ""
    saved = quantity.startswith("saved") and ck.kind in ("full", "fsdp1_full", "fsdp1_legacy")
    plan.update(mode="checkpoint", load_last=ck.after, saved=saved, load=not saved, quantity=quantity)
    return plan


ORACLE = Oracle("checkpoint", "silent (checkpoint)", signature, summary, address, title, expected_actual,
                lambda case, v: frame_source(v), what, expected, phase=lambda q: q.split(".")[0], script=script)
