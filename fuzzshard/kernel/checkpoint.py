"""The checkpoint oracles: what must survive a round trip (save mid-schedule,
load into a fresh model and optimizer, possibly on another world size, mesh
or wrapping; the saving and loading are state_io.py's and the targets').
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

from ..case import Case
from ..verdict import Mismatch
from .lowbit import lowbit_allowance, lowbit_plain
from .moe import set_biases
from .optim import add_late_groups, group_values
from .oracles import compare, compare_hparams
from .plain import anchor, setup
from .state_io import UNEXPECTED_KEY, as_tensor

EXACT = {"k_ulps": 0, "u": 0.0, "why": "a checkpoint copies values: exact"}


def check_saved(case: Case, saved: dict, rec: dict, device: str) -> list[dict]:
    """The full state dict on rank 0 vs the plain model's and optimizer's
    ``state_dict()`` holding the same params and state (``rec``: the sharded
    run's record of the step it saved after)."""
    step = case.checkpoint.after
    model, opt = setup(case, device)
    if 0 < case.optim.added_at <= step:
        add_late_groups(opt, model, case)
    anchor(model, opt, case, rec)
    if rec.get("expert_bias"):  # an MoE's routing bias: a persistent buffer, in the saved model state (kernel/moe.py)
        set_biases(model, rec["expert_bias"])
    if case.lr_scheduler:
        # the loop's scheduler moved the hyperparameters (and gave each group its initial_lr): they are the
        # sharded run's after this step, which the parity oracle holds to the reference loop's every step
        for group, values in zip(opt.param_groups, rec["groups"]):
            group.update(values)
    want_model, got_model = model.state_dict(), saved["model"]
    out = [compare("saved.model", step, key, got_model.get(key), want_model.get(key), EXACT)
           for key in sorted(set(want_model) | set(got_model))]
    want = opt.state_dict()
    index = {id(p): n for n, p in model.named_parameters()}
    by_index = [index[id(p)] for g in opt.param_groups for p in g["params"]]
    want_state = {by_index[i]: {k: as_tensor(v) for k, v in st.items()} for i, st in want["state"].items()}
    # (a low-bit optimizer's saved state: the values its codes stand for, kernel/lowbit.py)
    got_state = {n: {k: lowbit_plain(as_tensor(v)) for k, v in st.items()}
                 for n, st in saved["optim"].get("state", {}).items()}
    out += _compare_states("saved.optim.state", step, got_state, want_state)
    want_groups = [{**grp, "params": [by_index[i] for i in grp["params"]]} for grp in want["param_groups"]]
    got_groups = saved["optim"].get("param_groups", [])
    for i, (g, w) in enumerate(zip(got_groups, want_groups)):
        if sorted(g.get("params", [])) != sorted(w["params"]):
            out.append(Mismatch("saved.optim.param_groups.params", f"group {i}", step,
                                f"{g.get('params')} vs reference {w['params']}").to_dict())
    out.append(_prefixed("saved.optim.", compare_hparams(step, [group_values(g, skip=("params",)) for g in got_groups],
                                                         [group_values(w, skip=("params",)) for w in want_groups])))
    return [m for m in out if m]


def check_loaded(case: Case, loaded: dict, rec: dict) -> list[dict]:
    """Params, state and hyperparameters right after the load vs what was saved."""
    ck, step = case.checkpoint, case.checkpoint.after
    if ck.strict and (ck.missing or ck.unexpected):  # the load went through: it should not have
        keys = [f"missing {list(ck.missing)}"] * bool(ck.missing) + [f"unexpected {UNEXPECTED_KEY!r}"] * ck.unexpected
        return [Mismatch("loaded.strict", ", ".join(ck.missing + (UNEXPECTED_KEY,) * ck.unexpected), step,
                         f"a strict load accepted a model state dict with {' and '.join(keys)} keys; "
                         f"load_state_dict(strict=True) refuses it").to_dict()]
    # a non-strict load leaves a missing param as the fresh model had it
    want = {**rec["params"], **loaded.get("fresh", {})}
    out = [compare("loaded.param", step, n, loaded["params"][n], want[n], EXACT) for n in rec["params"]]
    # a low-bit optimizer's state loads into the loading side's blocks: requantized where they are not the saved
    # ones (kernel/lowbit.py), within one code interval of the loading side's layout
    out += _compare_states("loaded.state", step, loaded["state"], rec["state"], lowbit_allowance(case, step + 1,
                                                                                                 rec["state"]))
    out.append(_prefixed("loaded.", compare_hparams(step, loaded["groups"], rec["groups"])))
    return [m for m in out if m]


def _compare_states(what: str, step: int, got: dict, want: dict, allowance: dict | None = None) -> list[dict]:
    """{fqn: {name: tensor}} both sides, exactly (but ``allowance``, {fqn: name -> elementwise allowance or
    None}); a param whose whole state appeared or vanished is one ``.extra`` / ``.missing`` mismatch."""
    out = []
    for n in sorted(set(got) | set(want)):
        g, w = got.get(n, {}), want.get(n, {})
        if not g or not w:
            out.append(Mismatch(f"{what}.{'missing' if w else 'extra'}", n, step,
                                f"expected state {sorted(w)}, got {sorted(g)}").to_dict())
            continue
        allow = (allowance or {}).get(n, lambda key: None)
        out += [compare(f"{what}.{key}", step, n, g.get(key), w.get(key), EXACT, extra=allow(key))
                for key in sorted(set(g) | set(w))]
    return out


def _prefixed(prefix: str, m: dict | None) -> dict | None:
    if m:
        m["quantity"] = prefix + m["quantity"]
    return m


def check_loaded_loop(case: Case, saved: dict | None, loaded: dict | None) -> list[dict]:
    """The LR scheduler's and grad scaler's state right after the load vs what
    was saved (kernel/loop.py: plain values), key by key: exact."""
    if not saved and not loaded:
        return []
    out = []

    def walk(path: str, got, want):
        if isinstance(got, dict) and isinstance(want, dict):
            for key in sorted(set(got) | set(want)):
                walk(f"{path}.{key}", got.get(key), want.get(key))
        elif isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
            for i, (g, w) in enumerate(zip(got, want)):
                # a dict's place names it (SequentialLR's _schedulers.1); a value's does not, a 1-d tensor's
                # (a list: a tensor lr's _last_lr[2][0]) no more than a float's: which param group shows first
                # is incidental, as the hyperparameter is for the optimizer's (oracle/checkpoint.py)
                walk(f"{path}.{i}" if isinstance(g, dict) else f"{path}[{i}]", g, w)
        elif got != want and not (got != got and want != want):  # NaN equals NaN
            at = f" at {path[path.index('['):]}" if "[" in path else ""  # the entry: [group] of a tensor lr's list
            out.append(Mismatch(f"loaded.{path.split('[')[0]}", "", case.checkpoint.after,
                                f"{got!r} loaded, {want!r} saved{at}").to_dict())

    walk("", loaded or {}, saved or {})
    for m in out:
        m["quantity"] = m["quantity"].replace("loaded..", "loaded.")
    return out[:1] + out[1:8]  # the first is what names the finding; a few more say how far it goes
