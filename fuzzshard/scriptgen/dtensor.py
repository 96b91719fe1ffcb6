"""dtensor: every param a DTensor (``distribute_tensor`` with the case's placements),
inputs and buffers replicated, a plain torch.optim optimizer."""
from __future__ import annotations

from ..case import Case
from . import common, dsd

KINDS = dsd.KINDS
LOOP = True  # its scripts write the training loop around the step (loop.py)
DTENSOR_GRADS = True  # its grads are DTensors: a total norm over them is one
FREEZE_BEFORE_SHARD = False
MOE = True  # it writes the case's MoE layers (common.py's MoE class: on full copies of its DTensor params)


def imports(case: Case, options: dict) -> list[str]:
    return ["from torch.distributed.device_mesh import init_device_mesh",
            "from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor"] + \
        ["from torch.distributed.tensor.experimental import implicit_replication"] * bool(case.model.factory)


def unsupported(case: Case, options: dict) -> str | None:
    return None if set(options) <= {"placements"} else f"options {sorted(options)}"


def _placement(text: str) -> str:
    return "Replicate()" if text == "R" else f"Shard({text[1:]})"


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    rep = "[" + ", ".join(["Replicate()"] * len(shape)) + "]"
    given = {n: "[" + ", ".join(_placement(p) for p in pl) + "]" for n, pl in options.get("placements", {}).items()}
    given = {n: v for n, v in given.items() if v != rep}
    out = [f"mesh = {mesh}"]
    if given:
        out.append("layout = {" + ", ".join(f"{n!r}: {v}" for n, v in given.items()) + f"}}  # the rest {rep}")
    out += ["for name, p in list(model.named_parameters()):  # each param a DTensor",
            "    owner, _, attr = name.rpartition(\".\")",
            f"    dt = distribute_tensor(p.detach(), mesh, {'layout.get(name, ' + rep + ')' if given else rep})",
            "    setattr(model.get_submodule(owner), attr, nn.Parameter(dt))"]
    out += common.retie(case)
    if case.model.buffer:
        out.append(f"model.scale = distribute_tensor(model.scale, mesh, {rep})")
    return out + common.ac_lines(case, options)


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    return common.optimizer(case, lr_scale)


def global_loss(case: Case, world: int) -> list[str]:
    """The step's global loss for ReduceLROnPlateau: the replicated loss DTensor, made full."""
    return ["full_loss = float(loss.full_tensor())"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    rep = "[" + ", ".join(["Replicate()"] * len(shape)) + "]"
    out, y = f"model(distribute_tensor(x, mesh, {rep}))", f"distribute_tensor(y, mesh, {rep})"
    if case.model.factory:  # plain tensors its forward makes (positions) count as replicated, as the kernel says
        return ["with implicit_replication():", f"    out = {out}", f"loss = {common.loss(case, 'out', y)}", "loss.backward()"]
    return [f"loss = {common.loss(case, out, y)}", "loss.backward()"]


SNAPSHOT = [
    "def snapshot(model, opt):  # full copies: params, optimizer state by (param, name), param groups",
    "    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else torch.as_tensor(t)).detach().clone()",
    "    name = {q: n for n, q in model.named_parameters()}",
    "    return ({n: full(q) for n, q in model.named_parameters()},",
    "            {(name[q], k): full(v) for g in opt.param_groups for q in g[\"params\"] for k, v in opt.state.get(q, {}).items()},",
    "            [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()",
    "              if k not in (\"params\", \"param_names\")} for g in opt.param_groups])"]


def snapshot(case: Case, options: dict) -> list[str] | None:
    return SNAPSHOT


def grads(case: Case, options: dict) -> str | None:
    return "{n: None if q.grad is None else q.grad.full_tensor().clone() for n, q in model.named_parameters()}"
