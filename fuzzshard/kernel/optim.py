"""Build the optimizer of a Case, and move its state in and out by param FQN."""
from __future__ import annotations

import torch

from ..case import Case
from .gather import owned_copy
from .lowbit import LOWBIT_OPTIMIZERS, lowbit_class
from .model import named_params

# optimizers a plugin brings (fuzzshard.plugin.optimizer): name -> class, beside torch.optim's
USER_OPTIMIZERS: dict = {}


def optimizer_class(name: str):
    """The optimizer class a Case names: a plugin's, else torchao's low-bit AdamW's reference twin (--ao: its state
    never quantized, kernel/lowbit.py; the sharded side builds torchao's own), else torch.optim's."""
    if name not in USER_OPTIMIZERS and name in LOWBIT_OPTIMIZERS:
        return lowbit_class(name, reference=True)
    return USER_OPTIMIZERS.get(name) or getattr(torch.optim, name)


# the loading side of a checkpoint builds its optimizer with every lr scaled by
# this, so a load that leaves a hyperparameter alone shows
RESUME_LR_SCALE = 0.5

# kwargs torch documents as tuples; a Case stores them as JSON lists
_TUPLE_KWARGS = ("betas", "etas", "step_sizes", "eps", "ns_coefficients")


def optimizer_kwargs(kwargs: dict, tensor_lr: str, device, lr_scale: float = 1.0) -> dict:
    out = {}
    for k, v in kwargs.items():
        if k in _TUPLE_KWARGS and isinstance(v, list):
            v = tuple(v)
        if k == "lr":
            v = v * lr_scale
        if k == "lr" and tensor_lr:
            # a tensor lr on the CPU, as users make it (torch.optim takes one on any device)
            v = torch.tensor(v) if tensor_lr == "0d" else torch.tensor([v])
        out[k] = v
    return out


def build_optimizer(model: torch.nn.Module, case: Case, lr_scale: float = 1.0, construct=None,
                    params: dict | None = None) -> torch.optim.Optimizer:
    """The optimizer over the Case's param groups, in the Case's order; frozen
    params stay in their groups (torch.optim skips params without a grad).
    ``lr_scale``: the loading side of a checkpoint starts from other lrs.
    ``construct(groups, **defaults)``: another constructor (a wrapper such as
    ZeroRedundancyOptimizer) in place of the torch.optim class. ``params``:
    {fqn: param} where the model's own names are not the plain FQNs (FSDP1).
    Groups a case adds mid-run are left out (``add_late_groups``)."""
    cls = construct or optimizer_class(case.optim.name)
    groups = _groups(model, case, lr_scale, params)
    n = len(groups) - case.optim.added_groups  # the rest go in through add_param_group
    opt = cls(groups[:n], **optimizer_kwargs(case.optim.kwargs, case.optim.tensor_lr, case.device, lr_scale))
    if not case.optim.added_at:
        for g in groups[n:]:
            opt.add_param_group(g)
    return opt


def resume_defaults(opt, case: Case) -> None:
    """Make a reference optimizer's defaults the loading side's: the
    constructor's with every lr scaled, plus what ``load_state_dict`` adds to
    them (``differentiable``); the load restores the groups, not the defaults,
    and a group added after it inherits them."""
    opt.load_state_dict(opt.state_dict())
    if "lr" in case.optim.kwargs:
        opt.defaults.update(optimizer_kwargs({"lr": case.optim.kwargs["lr"]}, case.optim.tensor_lr, case.device,
                                             RESUME_LR_SCALE))


def adds_groups_before(case: Case, k: int) -> bool:
    """Whether the case adds its late groups right before schedule step ``k``."""
    return 0 < case.optim.added_at == k


def add_late_groups(opt, model: torch.nn.Module, case: Case, params: dict | None = None) -> None:
    """The groups a case adds mid-run (before step ``case.optim.added_at``),
    at the case's lrs: nothing loaded them, so nothing scales them."""
    for g in _groups(model, case, 1.0, params)[len(case.groups) - case.optim.added_groups:]:
        opt.add_param_group(g)


def _groups(model: torch.nn.Module, case: Case, lr_scale: float, params: dict | None) -> list[dict]:
    params = params if params is not None else named_params(model)
    return [{"params": [(n, params[n]) if case.optim.named else params[n] for n in g.params],
             **optimizer_kwargs(g.overrides, case.optim.tensor_lr, case.device, lr_scale)} for g in case.groups]


def param_order(case: Case) -> list[str]:
    """FQNs in the index order torch.optim uses in ``state_dict()``."""
    return [n for g in case.groups for n in g.params]


def state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, full) -> dict[str, dict[str, torch.Tensor]]:
    """{fqn: {state name: full plain tensor}} for every param that has state.
    ``full`` turns a sharded tensor into a full local copy (a collective)."""
    names = {id(p): n for n, p in named_params(model).items()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out[names[id(p)]] = {k: _full_value(v, full) for k, v in sorted(st.items())}
    return out


def _full_value(v, full):
    if isinstance(v, torch.Tensor):
        return owned_copy(full(v))
    return torch.tensor(v)  # python scalars some optimizers keep


def group_hparams(opt: torch.optim.Optimizer) -> list[dict]:
    """Every group's hyperparameters (params excluded), as comparable values."""
    return [group_values(group) for group in opt.param_groups]


def group_values(group: dict, skip=("params", "param_names")) -> dict:
    """One param group (a live one or a state dict's) as comparable values: tensors as lists."""
    return {k: v.detach().cpu().tolist() if isinstance(v, torch.Tensor) else v
            for k, v in sorted(group.items()) if k not in skip}


def load_state_by_fqn(opt: torch.optim.Optimizer, model: torch.nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace ``opt``'s per-param state with copies of ``state`` (plain full
    tensors), dtypes kept: ``load_state_dict`` would cast float state such as
    NAdam's float32 ``mu_product`` to the param dtype and change the numerics."""
    params = named_params(model)
    on_device = {id(p): bool(g.get("fused") or g.get("capturable")) for g in opt.param_groups for p in g["params"]}
    opt.state.clear()
    for n, st in state.items():
        p = params[n]
        # torch.optim keeps ``step`` on the CPU unless the group is fused or capturable (load_state_dict too)
        opt.state[p] = {k: v.to("cpu" if k == "step" and not on_device.get(id(p)) else p.device).clone()
                        for k, v in st.items()}
