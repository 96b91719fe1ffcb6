"""zero: ``ZeroRedundancyOptimizer`` over the whole model on every rank, grads
averaged by DDP (with its flags) or by hand, each rank on its slice of the batch;
its checkpoint is ``consolidate_state_dict`` + ``state_dict()``. What must hold
beyond parity: every rank's replica of every param is the same."""
from __future__ import annotations

from ..case import Case
from . import common

KINDS = ("consolidate",)
LOOP = True  # its scripts write the training loop around the step (loop.py)
FREEZE_BEFORE_SHARD = True  # DDP records the params that require grad when it wraps
GROUP = True  # on fewer ranks than the script's: a process group of its own
_OPTIONS = {"ddp", "bucket_view", "consolidate_to", "generator_groups"}
_DDP_DEFAULTS = {"broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False,
                 "static_graph": False}


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    return f"options {sorted(extra)}" if extra else None


def imports(case: Case, options: dict) -> list[str]:
    return ["from torch.distributed.optim import ZeroRedundancyOptimizer"] + \
        ["from torch.nn.parallel import DistributedDataParallel as DDP"] * ("ddp" in options)


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    if "ddp" not in options:
        return []
    kw = [f"{k}={v!r}" for k, v in options["ddp"].items() if _DDP_DEFAULTS.get(k) != v]
    kw += [f"process_group={group}"] if group else []
    return [f"ddp = DDP({', '.join(['model', *kw])})  # averages the grads"]


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    extra = ", ".join([f"optimizer_class={common.optim_class(case)}"] + [f"process_group={group}"] * bool(group)
                      + ["parameters_as_bucket_view=True"] * bool(options.get("bucket_view")))
    return common.optimizer(case, lr_scale, cls="ZeroRedundancyOptimizer", extra=extra,
                            iterator=bool(options.get("generator_groups")))


def check_GroupsLost(case: Case) -> list[str]:
    return ["held = {id(q) for g in opt.param_groups for q in g[\"params\"]}",
            "lost = [n for n, q in model.named_parameters() if id(q) not in held and any(n in g for g in "
            f"{[list(g.params) for g in case.groups]!r})]",
            "assert not lost, f\"ZeroRedundancyOptimizer's param groups lack {lost}, which it was given\""]


def global_loss(case: Case, world: int) -> list[str]:
    """The step's global loss for ReduceLROnPlateau: each rank's slice, all-reduced over the optimizer's group in
    its dtype, as the kernel's."""
    return ["full_loss = loss.detach().clone()", "dist.all_reduce(full_loss, group=opt.process_group)",
            f"full_loss = float(full_loss / {world})"] if world > 1 else ["full_loss = float(loss)"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    per = case.batch // world
    out = [f"x, y = x[{per} * rank:{per} * rank + {per}], y[{per} * rank:{per} * rank + {per}]  # this rank's slice"] \
        if world > 1 else []
    out += [f"loss = {common.loss(case, ('ddp' if 'ddp' in options else 'model') + '(x)', 'y')}", "loss.backward()"]
    if "ddp" not in options and world > 1:
        out += ["for q in model.parameters():  # grads averaged by hand", "    if q.grad is not None:",
                "        dist.all_reduce(q.grad, group=opt.process_group)", f"        q.grad.div_({world})"]
    return out


def snapshot(case: Case, options: dict) -> list[str] | None:
    return ["def snapshot(model, opt):  # params (every rank's replica the same), optimizer state (each rank: its partition's)",
            "    local, group = getattr(opt, \"optim\", opt), getattr(opt, \"process_group\", None)  # (a plain one: all of it)",
            "    name, world = {q: n for n, q in model.named_parameters()}, dist.get_world_size(group)",
            "    for n, q in model.named_parameters():",
            "        reps = [torch.empty_like(q) for _ in range(world)]",
            "        dist.all_gather(reps, q.detach().contiguous(), group=group)",
            "        assert all(torch.equal(r, reps[0]) for r in reps), f\"the replicas of {n} differ: {[r.tolist() for r in reps]}\"",
            "    mine = {(name[q], k): torch.as_tensor(v).clone() for g in local.param_groups for q in g[\"params\"]",
            "            for k, v in local.state.get(q, {}).items()}",
            "    parts = [None] * world",
            "    dist.all_gather_object(parts, mine, group=group)",
            "    return ({n: q.detach().clone() for n, q in model.named_parameters()}, {k: v for s in parts for k, v in s.items()},",
            "            [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()",
            "              if k not in (\"params\", \"param_names\")} for g in opt.param_groups])"]


def grads(case: Case, options: dict) -> str | None:
    return "{n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}"


def imports_consolidate(case: Case) -> list[str]:
    return []


def save_consolidate(case: Case, group: str) -> list[str]:
    to = case.target_options.get("consolidate_to", 0)
    return [f"opt.consolidate_state_dict(to={to})",
            f"if rank == {to}:", "    torch.save({\"model\": model.state_dict(), \"optim\": opt.state_dict()}, f\"{ckpt}/zero.pt\")"]


def load_consolidate(case: Case, group: str) -> list[str]:
    return ["sd = torch.load(f\"{ckpt}/zero.pt\", map_location=\"cpu\")  # every rank loads the whole state",
            "model.load_state_dict(sd[\"model\"])", "opt.load_state_dict(sd[\"optim\"])"]


def check_PartitionBroken(case: Case) -> list[str]:
    given = [n for g in case.groups[:len(case.groups) - case.optim.added_groups] for n in g.params]
    return ["owners = [None] * dist.get_world_size(opt.process_group)  # each rank: the params its partition steps",
            "dist.all_gather_object(owners, [n for n, q in model.named_parameters() for g in opt.optim.param_groups if any(q is x for x in g[\"params\"])],",
            "                       group=opt.process_group)",
            f"count = {{n: sum(n in o for o in owners) for n in {given!r}}}",
            "assert all(c == 1 for c in count.values()), f\"ZeRO's partitions give params other than one owner each: {count}\""]
