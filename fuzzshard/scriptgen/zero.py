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
_OPTIONS = {"ddp", "bucket_view", "consolidate_to", "generator_groups", "uneven", "local"}
_DDP_DEFAULTS = {"broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False,
                 "static_graph": False}


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    return f"options {sorted(extra)}" if extra else None


def imports(case: Case, options: dict) -> list[str]:
    return ["from torch.distributed.optim import ZeroRedundancyOptimizer"] * (not options.get("local")) + \
        ["from torch.nn.parallel import DistributedDataParallel as DDP"] * ("ddp" in options) + \
        ["from torch.distributed.algorithms.join import Join, Joinable, JoinHook",
         "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook"] * bool(options.get("uneven"))


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    if "ddp" not in options:
        return common.ac_lines(case, options)
    kw = [f"{k}={v!r}" for k, v in options["ddp"].items() if _DDP_DEFAULTS.get(k) != v]
    kw += [f"process_group={group}"] if group else []
    out = common.ac_lines(case, options) + [f"ddp = DDP({', '.join(['model', *kw])})  # averages the grads"]
    counts = options.get("uneven")
    if counts:  # kernel/targets/zero.py uneven: the loop under Join, DDP's averaging as a comm hook
        per, world = case.batch // len(counts), len(counts)
        out += [f"counts = {list(counts)!r}  # uneven inputs: rank r runs the first counts[r] steps, then joins",
                "joined = False",
                "def averaged(state, bucket):  # DDP's averaging; on a joined rank its result (the others' grads) is made",
                "    fut = allreduce_hook(None, bucket)  # this rank's grads, which ZeRO's join hook steps from",
                "    if not joined:", "        return fut",
                "    def set_grads(done):", "        for q, g in zip(bucket.parameters(), bucket.gradients()):",
                "            q.grad = g.detach().clone()", "        return done.value()", "    return fut.then(set_grads)",
                "ddp.register_comm_hook(None, averaged)",
                f"def active(k):  # the batch rows of the ranks that run step k (the plain replay's batch)",
                f"    return torch.cat([torch.arange({per} * r, {per} * (r + 1)) for r in range({world}) if counts[r] > k])"]
    return out


def objective(case: Case, net: str, x: str) -> str:
    """The plain replay's loss (kernel/targets/zero.py reference_batch): with uneven inputs only the slices of the
    ranks that run step k, and DDP averages over the whole world: their mean loss times their share of it."""
    if not case.target_options.get("uneven"):
        return common.loss(case, f"{net}({x})", "y")
    return f"({common.loss(case, f'{net}({x}[active(k)])', 'y[active(k)]')} * len(active(k)) / {case.batch})"


def joined_steps(case: Case, options: dict):
    """With uneven inputs, the steps as the kernel runs them: inside ``Join([ddp, ..., opt, ...])``, a rank out of
    steps joined (DDP's join hook shadows the all-reduce, ZeRO's steps its partition and broadcasts it), the
    script's own observations after the backward and after the step shadowed on a joined rank by a Joinable
    of their own, in the same order. A function of the step's parts (see Writer.steps), or None."""
    if not options.get("uneven"):
        return None

    def write(body, seen_grads, mid, seen_step, first, last):
        n = len(case.schedule)
        mine = "counts[rank]" if last + 1 >= n else f"min(counts[rank], {last + 1})"
        shadows, out = [], []
        for name, lines, when in (("seen_grads", seen_grads, "backward"), ("seen_step", seen_step, "step")):
            if lines:
                out += [f"def {name}():  # what each step observes after its {when} (a joined rank: in Join's shadow)",
                        "    global seen, fail", *common.indent([ln.replace("fail += ", "fail = fail + ")
                                                                for ln in lines])]
                shadows.append(name)
        if shadows:
            out += ["class Shadow(Joinable):  # a joined rank's part in the script's own collectives, each step",
                    "    def __init__(self, fn):", "        super().__init__()", "        self.fn = fn",
                    "    def join_hook(self, **kwargs):", "        hook = JoinHook()", "        hook.main_hook = self.fn",
                    "        return hook", "    join_device, join_process_group = device, dist.group.WORLD"]
        hooks = ["ddp"] + [f"Shadow({shadows[0]})"] * ("seen_grads" in shadows) + ["opt"] + \
            [f"Shadow({shadows[-1]})"] * ("seen_step" in shadows)
        steps = body + ["seen_grads()"] * ("seen_grads" in shadows) + mid + ["seen_step()"] * ("seen_step" in shadows)
        return out + [f"with Join([{', '.join(hooks)}]):  # a rank out of steps joins: the hooks shadow the others' steps",
                      f"    for k in range({first}, {mine}):" if first else f"    for k in range({mine}):",
                      *common.indent(steps, 8), "    joined = True  # (averaged: the grads a joined rank steps from)"]
    return write


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    if options.get("local"):  # (a loading side): resume with the plain torch.optim optimizer
        return common.optimizer(case, lr_scale)
    extra = ", ".join([f"optimizer_class={common.optim_class(case)}"] + [f"process_group={group}"] * bool(group)
                      + ["parameters_as_bucket_view=True"] * bool(options.get("bucket_view")))
    return common.optimizer(case, lr_scale, cls="ZeroRedundancyOptimizer", extra=extra,
                            iterator=bool(options.get("generator_groups")))


def _local(case: Case) -> bool:
    """Whether the steps running now are a loading side's that resumed with the plain optimizer (``local``)."""
    return bool(case.checkpoint and case.checkpoint.target_options.get("local"))


def check_GroupsLost(case: Case) -> list[str]:
    return ["held = {id(q) for g in opt.param_groups for q in g[\"params\"]}",
            "lost = [n for n, q in model.named_parameters() if id(q) not in held and any(n in g for g in "
            f"{[list(g.params) for g in case.groups]!r})]",
            "assert not lost, f\"ZeroRedundancyOptimizer's param groups lack {lost}, which it was given\""]


def global_loss(case: Case, world: int) -> list[str]:
    """The step's global loss for ReduceLROnPlateau: each rank's slice, all-reduced over the optimizer's group in
    its dtype, as the kernel's."""
    over = "" if _local(case) else ", group=opt.process_group"
    return ["full_loss = loss.detach().clone()", f"dist.all_reduce(full_loss{over})",
            f"full_loss = float(full_loss / {world})"] if world > 1 else ["full_loss = float(loss)"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    per = case.batch // world
    out = [f"x, y = x[{per} * rank:{per} * rank + {per}], y[{per} * rank:{per} * rank + {per}]  # this rank's slice"] \
        if world > 1 else []
    out += [f"loss = {common.loss(case, ('ddp' if 'ddp' in options else 'model') + '(x)', 'y')}", "loss.backward()"]
    if "ddp" not in options and world > 1:
        out += ["for q in model.parameters():  # grads averaged by hand", "    if q.grad is not None:",
                f"        dist.all_reduce(q.grad{'' if options.get('local') else ', group=opt.process_group'})",
                f"        q.grad.div_({world})"]
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
