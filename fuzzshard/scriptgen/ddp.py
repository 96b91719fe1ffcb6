"""ddp: ``DistributedDataParallel`` (or ``_composable.replicate``) around the whole
model with the case's flags, each rank on its slice of the batch, microbatches
under ``no_sync()``, ignored params averaged by hand, DDP's all-reduce as a comm
hook; the checkpoint through DSD on the wrapper, or the wrapper's own state dict.
What must hold beyond parity: every rank's replica of every param is the same.
Written for the kernel's options but the gated layer, the lossy and PowerSGD
hooks (their allowances are the kernel's) and Join's uneven inputs: those fall back."""
from __future__ import annotations

from ..case import Case
from . import common, dsd
from .dtensor import SNAPSHOT

KINDS = dsd.KINDS + ("module",)
LOOP = True  # its scripts write the training loop around the step (loop.py)
FREEZE_BEFORE_SHARD = True  # DDP records the params that require grad when it wraps
GROUP = True  # on fewer ranks than the script's: a process group of its own
_OPTIONS = {"ddp", "microbatches", "synced_first", "ignore", "hook", "replicate", "plain"}


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    if extra:
        return f"options {sorted(extra)}"
    hook = (options.get("hook") or {}).get("name", "allreduce")
    return None if hook == "allreduce" else f"the comm hook {hook} (its allowance is the kernel's)"


def imports(case: Case, options: dict) -> list[str]:
    out = ["from torch.distributed.tensor import DTensor"]
    out += ["import contextlib"] * (options.get("microbatches", 1) > 1 and not options.get("replicate"))
    out += ["from torch.distributed._composable.replicate import replicate"] if options.get("replicate") else \
        ["from torch.nn.parallel import DistributedDataParallel as DDP"]
    if options.get("hook"):
        out.append("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook")
    return out


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    kw = [f"{k}={v!r}" for k, v in options.get("ddp", {}).items()] + [f"process_group={group}"] * bool(group)
    out = []
    if options.get("replicate"):
        out.append(f"ddp = replicate({', '.join(['model', 'device_id=torch.device(device)', *kw])})  # composable DDP")
    else:
        if options.get("ignore"):
            out.append(f"DDP._set_params_and_buffers_to_ignore_for_model(model, {list(options['ignore'])!r})")
        out.append(f"ddp = DDP({', '.join(['model', *kw])})  # averages the grads")
    if options.get("hook"):
        out.append(f"ddp.register_comm_hook({group or 'None'}, allreduce_hook)")
    if options.get("synced_first"):
        out.append("ddp.steps_run = 0  # its first step syncs every microbatch")
    return out


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    return common.optimizer(case, lr_scale)


def global_loss(case: Case, world: int) -> list[str]:
    """The step's global loss for ReduceLROnPlateau: each rank's, all-reduced, as the kernel's."""
    return ["full_loss = loss.detach().clone()", "dist.all_reduce(full_loss)",
            f"full_loss = float(full_loss / {world})"] if world > 1 else ["full_loss = float(loss)"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    per, m = case.batch // world, options.get("microbatches", 1)
    out = [f"x, y = x[{per} * rank:{per} * rank + {per}], y[{per} * rank:{per} * rank + {per}]  # this rank's slice"] \
        if world > 1 else []
    if m == 1:
        out += [f"loss = {common.loss(case, 'ddp(x)', 'y')}", "loss.backward()"]
    else:
        last = f"i == {m - 1}"
        if options.get("synced_first"):
            out += ["synced = ddp.steps_run < 1", "ddp.steps_run += 1"]
            last = f"synced or {last}"
        sync = f"ddp.set_requires_gradient_sync({last})" if options.get("replicate") else \
            f"with (contextlib.nullcontext() if {last} else ddp.no_sync()):  # accumulate, sync on the last"
        body = [f"part = {common.loss(case, 'ddp(xm)', 'ym')} / {m}", "part.backward()",
                "loss = part.detach() + (loss if i else 0)"]
        out += [f"for i, (xm, ym) in enumerate(zip(x.chunk({m}), y.chunk({m}))):  # grad accumulation",
                f"    {sync}"] + common.indent(body, 8 if not options.get("replicate") else 4)
    for n in options.get("ignore", ()):
        out += [f"g = model.get_parameter({n!r}).grad  # ignored by DDP: averaged by hand",
                f"if g is not None:", "    dist.all_reduce(g)", f"    g.div_({world})"]
    return out


def snapshot(case: Case, options: dict) -> list[str] | None:
    return SNAPSHOT


def grads(case: Case, options: dict) -> str | None:
    return "{n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}"


# the state-dict kinds through DSD on the wrapper (it drops DDP's module. prefix), as the kernel's
def _on_wrapper(lines: list[str]) -> list[str]:
    return [ln.replace("state_dict(model, ", "state_dict(ddp, ") for ln in lines]


def _load_dsd(case: Case, group: str) -> list[str]:
    lines = dsd.load(case, group)
    return lines if case.checkpoint.target_options.get("plain") else _on_wrapper(lines)  # plain: into the model


for _kind in dsd.KINDS:
    globals()[f"imports_{_kind}"] = dsd.imports
    globals()[f"save_{_kind}"] = lambda case, group: _on_wrapper(dsd.save(case, group))
    globals()[f"load_{_kind}"] = _load_dsd


def imports_module(case: Case) -> list[str]:
    return ["from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present"]


def save_module(case: Case, group: str) -> list[str]:
    return ["if rank == 0:  # the wrapper's own state dict (DDP's: keys under module.)",
            "    torch.save({\"model\": ddp.state_dict(), \"optim\": opt.state_dict()}, f\"{ckpt}/ddp_module.pt\")"]


def load_module(case: Case, group: str) -> list[str]:
    o = case.checkpoint.target_options
    into = "ddp" if not (o.get("plain") or o.get("replicate")) else "model"
    out = ["sd = torch.load(f\"{ckpt}/ddp_module.pt\", map_location=\"cpu\")"]
    if into == "ddp":
        out += ["if not all(k.startswith(\"module.\") for k in sd[\"model\"]):  # saved by replicate(): no prefix",
                "    sd[\"model\"] = {\"module.\" + k: v for k, v in sd[\"model\"].items()}"]
    else:
        out.append("consume_prefix_in_state_dict_if_present(sd[\"model\"], \"module.\")  # into the plain model")
    return out + [f"{into}.load_state_dict(sd[\"model\"])", "opt.load_state_dict(sd[\"optim\"])"]
