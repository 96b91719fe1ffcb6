"""The checkpoint round trip: save mid-schedule, load into a fresh model and
optimizer (possibly on another world size, mesh or wrapping), and what must
survive it.

Saving and loading go through torch's own APIs (``get_state_dict`` /
``set_state_dict``, ``torch.save`` of the full dict, ``dcp.save`` /
``dcp.load`` with the file-system writer and reader) into a real directory.
The loading side starts from a different init and every lr halved, so a load
that silently does nothing, for a param, a state tensor or a hyperparameter,
shows. The oracles, in the order they run (training parity is run.py's):
  - *saved*: the full state dict saved on rank 0 equals what the plain model's
    ``state_dict()`` and the plain optimizer's ``state_dict()`` hold for the
    same state, keys by FQN: every tensor, ``step``, every group's params and
    hyperparameters, frozen and never-stepped params included;
  - *loaded*: right after the load the params, optimizer state and every
    group's hyperparameters equal the saved ones exactly (a copy, not math);
  - training then continues, and the anchored parity check of the continued
    steps against the reference is the usual one.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..case import Case
from .model import plain_fqn
from .optim import add_late_groups, group_values
from .oracles import compare, compare_hparams
from .reference import _anchor, _plain_setup

FULL_FILE = "full.pt"
# the round trips through torch.distributed.checkpoint's state-dict API (set_state_dict: split and strict
# apply), in draw order, each with how it saves and loads
STATE_DICT_KINDS = {"full": "full state dict, torch.save on rank 0, torch.load on every rank",
                    "dcp": "sharded state dict through torch.distributed.checkpoint",
                    "broadcast": "full state dict, read by rank 0, set_state_dict(broadcast_from_rank0=True)"}
EXACT = {"k_ulps": 0, "u": 0.0, "why": "a checkpoint copies values: exact"}


def save(case: Case, model, opt, path: str, group) -> dict | None:
    """Collective over the saving job; rank 0 returns what it saved (full kinds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if case.checkpoint.kind == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(os.path.join(path, "dcp")),
                 process_group=group)
        return None
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    torch.save({"model": msd, "optim": osd}, os.path.join(path, FULL_FILE))
    return {"model": msd, "optim": osd}


def load(case: Case, model, opt, path: str, group) -> None:
    """Collective over the loading job: the checkpoint into a fresh model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict, set_state_dict)

    ck = case.checkpoint
    missing = _keys_of(model, ck.missing)
    if ck.kind == "dcp":
        msd, osd = get_state_dict(model, opt)  # the sharded layout to load into
        # dcp.load fills the model's own tensors in place: a missing key is one it is not asked for
        sd = {"model": _without(msd, missing), "optim": osd}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), process_group=group)
        msd, osd = sd["model"], sd["optim"]
        options = StateDictOptions(strict=ck.strict)
    else:
        broadcast = ck.kind == "broadcast"
        msd, osd = {}, {}
        if not broadcast or dist.get_rank() == 0:
            saved = torch.load(os.path.join(path, FULL_FILE))
            msd, osd = saved["model"], saved["optim"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=ck.strict)
    if msd:  # (not on a broadcast rank that holds nothing)
        msd = _without(msd, missing)
        if ck.unexpected:
            msd[UNEXPECTED_KEY] = torch.zeros(2)
    if ck.split:
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
    else:
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


UNEXPECTED_KEY = "fuzzshard_unexpected.weight"


def _keys_of(model, fqns) -> set[str]:
    """Every state-dict key of these params: a tied param has one per module
    holding it, and is missing only when all of them are."""
    if not fqns:
        return set()
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_fqn(n))
    return set(fqns) | {k for keys in names.values() if set(keys) & set(fqns) for k in keys}  # (flat params: by name)


def _without(msd: dict, keys: set[str]) -> dict:
    """A copy of the state dict without ``keys`` (a copy: DSD rewrites the dict it loads)."""
    return {k: v for k, v in msd.items() if k not in keys}


def check_saved(case: Case, saved: dict, rec: dict, device: str) -> list[dict]:
    """The full state dict on rank 0 vs the plain model's and optimizer's
    ``state_dict()`` holding the same params and state (``rec``: the sharded
    run's record of the step it saved after)."""
    step = case.checkpoint.after
    model, opt = _plain_setup(case, device)
    if 0 < case.optim.added_at <= step:
        add_late_groups(opt, model, case)
    _anchor(model, opt, case, rec)
    want_model, got_model = model.state_dict(), saved["model"]
    out = [compare("saved.model", step, key, got_model.get(key), want_model.get(key), EXACT)
           for key in sorted(set(want_model) | set(got_model))]
    want = opt.state_dict()
    index = {id(p): n for n, p in model.named_parameters()}
    by_index = [index[id(p)] for g in opt.param_groups for p in g["params"]]
    want_state = {by_index[i]: {k: _tensor(v) for k, v in st.items()} for i, st in want["state"].items()}
    got_state = {n: {k: _tensor(v) for k, v in st.items()} for n, st in saved["optim"].get("state", {}).items()}
    out += _compare_states("saved.optim.state", step, got_state, want_state)
    want_groups = [{**grp, "params": [by_index[i] for i in grp["params"]]} for grp in want["param_groups"]]
    got_groups = saved["optim"].get("param_groups", [])
    for i, (g, w) in enumerate(zip(got_groups, want_groups)):
        if sorted(g.get("params", [])) != sorted(w["params"]):
            out.append({"quantity": "saved.optim.param_groups.params", "step": step, "fqn": f"group {i}",
                        "detail": f"{g.get('params')} vs reference {w['params']}"})
    out.append(_prefixed("saved.optim.", compare_hparams(step, [group_values(g, skip=("params",)) for g in got_groups],
                                                         [group_values(w, skip=("params",)) for w in want_groups])))
    return [m for m in out if m]


def check_loaded(case: Case, loaded: dict, rec: dict) -> list[dict]:
    """Params, state and hyperparameters right after the load vs what was saved."""
    ck, step = case.checkpoint, case.checkpoint.after
    if ck.strict and (ck.missing or ck.unexpected):  # the load went through: it should not have
        keys = [f"missing {list(ck.missing)}"] * bool(ck.missing) + [f"unexpected {UNEXPECTED_KEY!r}"] * ck.unexpected
        return [{"quantity": "loaded.strict", "step": step, "fqn": ", ".join(ck.missing + (UNEXPECTED_KEY,) * ck.unexpected),
                 "detail": f"a strict load accepted a model state dict with {' and '.join(keys)} keys; "
                           f"load_state_dict(strict=True) refuses it"}]
    # a non-strict load leaves a missing param as the fresh model had it
    want = {**rec["params"], **loaded.get("fresh", {})}
    out = [compare("loaded.param", step, n, loaded["params"][n], want[n], EXACT) for n in rec["params"]]
    out += _compare_states("loaded.state", step, loaded["state"], rec["state"])
    out.append(_prefixed("loaded.", compare_hparams(step, loaded["groups"], rec["groups"])))
    return [m for m in out if m]


def _compare_states(what: str, step: int, got: dict, want: dict) -> list[dict]:
    """{fqn: {name: tensor}} both sides, exactly; a param whose whole state
    appeared or vanished is one ``.extra`` / ``.missing`` mismatch."""
    out = []
    for n in sorted(set(got) | set(want)):
        g, w = got.get(n, {}), want.get(n, {})
        if not g or not w:
            out.append({"quantity": f"{what}.{'missing' if w else 'extra'}", "step": step, "fqn": n,
                        "detail": f"expected state {sorted(w)}, got {sorted(g)}"})
            continue
        out += [compare(f"{what}.{key}", step, n, g.get(key), w.get(key), EXACT) for key in sorted(set(g) | set(w))]
    return out


def _prefixed(prefix: str, m: dict | None) -> dict | None:
    if m:
        m["quantity"] = prefix + m["quantity"]
    return m


def _tensor(v):
    return v if v is None or isinstance(v, torch.Tensor) else torch.tensor(v)
