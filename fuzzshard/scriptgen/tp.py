"""tp: ``parallelize_module`` with the case's plan (ColwiseParallel /
RowwiseParallel per Linear or Embedding) on a 1-D mesh of every rank; each
param the plan leaves plain a replicated DTensor, its module fed and giving
plain tensors (``distribute_module``); every rank trains on the whole batch."""
from __future__ import annotations

from ..case import Case
from . import common, dsd, dtensor

KINDS = dsd.KINDS
LOOP = True  # its scripts write the training loop around the step (loop.py)
DTENSOR_GRADS = True  # its grads are DTensors: a total norm over them is one
FREEZE_BEFORE_SHARD = False
grads = dtensor.grads  # every param a DTensor, every grad gathered with full_tensor(), as dtensor's


def unsupported(case: Case, options: dict) -> str | None:
    return None if set(options) <= {"tp"} else f"options {sorted(options)}"


def imports(case: Case, options: dict) -> list[str]:
    styles = sorted({"ColwiseParallel" if s == "colwise" else "RowwiseParallel" for s in options.get("tp", {}).values()})
    return ["from torch.distributed.device_mesh import init_device_mesh",
            "from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor",
            f"from torch.distributed.tensor.parallel import {', '.join(styles + ['parallelize_module'])}"]


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    style = {"colwise": "ColwiseParallel(output_layouts=Replicate())",
             "rowwise": "RowwiseParallel(input_layouts=Replicate())"}
    plan = ", ".join(f"{fqn!r}: {style[s]}" for fqn, s in options.get("tp", {}).items())
    return [f"mesh = {mesh}",
            f"parallelize_module(model, mesh, {{{plan}}})  # TP on every rank, no FSDP",
            "done = {}  # each param the plan left plain: a replicated DTensor (a tied one once)",
            "for m in list(model.modules()):",
            "    plain = [(k, q) for k, q in m.named_parameters(recurse=False) if not isinstance(q, DTensor)]",
            "    for k, q in plain:",
            "        if id(q) not in done:",
            "            done[id(q)] = nn.Parameter(distribute_tensor(q.detach(), mesh, [Replicate()]), q.requires_grad)",
            "        m.register_parameter(k, done[id(q)])",
            "    if plain:  # ... its module fed replicated DTensors, giving plain tensors",
            "        distribute_module(m, mesh, input_fn=lambda mod, args, mesh: tuple(",
            "            a if isinstance(a, DTensor) else DTensor.from_local(a, mesh, [Replicate()], run_check=False)",
            "            for a in args), output_fn=lambda mod, out, mesh: out.to_local() if isinstance(out, DTensor) else out)"]


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    return common.optimizer(case, lr_scale)


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    return [f"loss = {common.loss(case, 'model(x)', 'y')}  # every rank: the whole batch", "loss.backward()"]


def snapshot(case: Case, options: dict) -> list[str] | None:
    return dtensor.SNAPSHOT
