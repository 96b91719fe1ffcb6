"""pp: ``torch.distributed.pipelining``'s stages and schedules, written straight-line.

Every rank builds the whole model (the kernel's init) and cuts its top-level
``model.layers`` at the case's ``cuts``: stage s is ``model.layers[cuts[s]:cuts[s + 1]]``
(the last one times the output ``scale`` buffer, where the model has one), a
``PipelineStage`` on the rank the schedule puts it (kernel/targets/pp/schedules.py's
``stage_ranks``: one a rank, looped, or V-shaped), and the schedule class runs
``n_microbatches`` with ``loss_fn`` and ``scale_grads``. Each rank's optimizer
holds its own params (``own``: its stages' layers, and ``unused`` on the last
stage's rank) with the case's param groups restricted to them, as the kernel's
(a group with none of them left out, ``kept``: the case's index of each group it
holds). The schedule's step gets the inputs on the first stage's rank (rank 0)
and the targets everywhere. Params, grads and optimizer state each live on one
rank: ``snapshot`` and ``gather`` merge every rank's own with one
``all_gather_object``, the param groups in the case's order (each from the
lowest rank that holds its params), as the target's observations do. The plain
model's replay (scriptgen/checks.py) trains on the same microbatches:
``objective`` is the kernel's (the sum of the microbatch losses, their mean
with ``scale_grads``), with the kernel's bounds.

Written on the CPU: the topologies and the decoder (a
``Stage`` module per stage: its blocks, the embedding on the first, the norm
and head on the last); FSDP2 on a [pp, dp] mesh (torchtitan's composition: the
``wrap`` layers, then each stage, ``fully_shard``-ed over dp; the pipeline over
this dp index's pp ranks, ``pp_rank`` where the 1-D script says ``rank``; each
dp rank on its slice of the batch; params, grads and state made ``full`` before
they are gathered; the plain objective the mean over the dp slices); gradient
accumulation (``accum`` schedule steps on equal parts of the batch, whose
objective counts step a of A 1 / n_microbatches^(A - a) with scale_grads); the
LR scheduler (ReduceLROnPlateau fed the last stage's loss); the checkpoint
(``dcp``, torchtitan's: each rank's model ``part`` and its optimizer state
dict flattened by plain FQN, in one DCP checkpoint, or dcp.async_save; loaded
into the loading side's parts at its own pp degree, world size and mesh, as
kernel/targets/pp/checkpoint.py's save / load). Anything else (cuda, groups added later, dropout)
falls back to the flattened kernel and ``unsupported`` says what."""
from __future__ import annotations

from ..case import Case
from ..kernel.dropout import has_dropout
from ..kernel.model import param_shapes, tie_uses
from ..kernel.targets.pp import draws, schedules
from . import common

KINDS = ("dcp",)  # torchtitan's pipeline checkpoint (kernel/targets/pp/checkpoint.py save / load): save_dcp, load_dcp
FREEZE_BEFORE_SHARD = False  # the kernel sets requires_grad after cutting the stages
REPLICAS = ()  # each param lives on one rank: nothing replicated to compare
BATCH = "the whole batch, in the schedule's microbatches"  # what the plain model's replay trains on
LOOP = True  # the LR scheduler (the only part of the loop pp draws) in torch's words: each rank's over its own groups
LAST_LR = "in_case_order([float(v) for v in sched.get_last_lr()])"  # the lrs of every rank's groups, in the case's order
# the options written (FSDP2 on a [pp, dp] mesh: dp, wrap, reshard_after_forward)
OPTIONS = {"schedule", "stages", "cuts", "scale_grads", "n_microbatches", "accum", "dp", "wrap", "reshard_after_forward"}


def unsupported(case: Case, options: dict) -> str | None:
    extra = sorted(set(options) - OPTIONS)
    if extra:
        return f"options {extra} (the script writes one pipeline over every rank, without them)"
    if len(case.mesh_shape) != 1 and not options.get("dp"):
        return f"on the mesh {list(case.mesh_shape)} (the script writes a 1-D pipeline, or [pp, dp] with FSDP2)"
    if case.device != "cpu":
        return "on cuda (the script gathers the stages' tensors on the CPU)"
    if case.optim.added_groups:
        return "param groups added after the constructor (each rank adds only its own)"
    if has_dropout(case.model):
        return ("dropout (the kernel's reference replays each stage's masks from its rank's seed, stage after stage "
                "over the microbatches: not written)")
    if schedules.uncuttable(case.model) or draws.check(case):
        return draws.check(case) or schedules.uncuttable(case.model)
    if tie_uses(case.model) and (options.get("dp") or case.checkpoint):  # (fully_shard renames a stage's tied
        # weight on the head's rank, and the kernel's part holds it under its owner's FQN there: not written yet)
        return "a tied weight with FSDP2 stages or a checkpoint"
    return None


def imports(case: Case, options: dict) -> list[str]:
    out = [f"from torch.distributed.pipelining import PipelineStage, Schedule{options['schedule']}"]
    if options.get("dp"):
        out += ["from torch.distributed.device_mesh import init_device_mesh", "from torch.distributed.fsdp import fully_shard",
                "from torch.distributed.tensor import DTensor"]
    return out


def _rank(options: dict) -> str:
    """The script's name for this rank's place in the pipeline: ``pp_rank`` on a [pp, dp] mesh, else ``rank``."""
    return "pp_rank" if options.get("dp") else "rank"


def _world(case: Case, options: dict) -> int:
    """The world size of the side whose options these are (a checkpoint's loading side: its own)."""
    return case.checkpoint.world_size if case.checkpoint and options is case.checkpoint.target_options \
        else case.world_size


def _layout(case: Case, options: dict) -> tuple[list[list[int]], list[int]]:
    """(each stage's top-level layers, each stage's rank): the kernel's own split."""
    return (schedules.stage_layers(options, schedules.n_units(case.model)),
            schedules.stage_ranks(options, _world(case, options)))


def owned(case: Case, options: dict) -> list[list[str]]:
    """Each rank's params, by plain FQN, in the model's order (what its optimizer may hold)."""
    layers, ranks = _layout(case, options)
    layer_rank = {i: r for s, ls in enumerate(layers) for i in ls for r in [ranks[s]]}
    out = [[] for _ in range(schedules.pp_degree(options, _world(case, options)))]
    for n in param_shapes(case.model):
        head, _, rest = n.partition(".")
        # (the decoder's embedding on the first stage's rank; its norm and head, unused, on the last stage's)
        r = layer_rank[int(rest.split(".")[0])] if head == "layers" else ranks[0] if head == "tok_embeddings" else ranks[-1]
        out[r].append(n)
    return out


def kept(case: Case, options: dict) -> list[list[int]]:
    """Each rank's groups, as the case's indices: a group with none of its params left out, unless the case's
    group is empty itself; a rank with none at all holds the first, empty (kernel/targets/pp/target.py optimizer)."""
    out = []
    for mine in map(set, owned(case, options)):
        out.append([i for i, g in enumerate(case.groups) if not g.params or mine & set(g.params)] or [0])
    return out


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    layers, ranks = _layout(case, options)
    n, name = len(ranks), options["schedule"]
    cuts = [ls[0] for ls in layers] + [schedules.n_units(case.model)]
    style = {"single": "one a rank", "multi": f"{options.get('stages', 1)} a rank, looped",
             "v": "two a rank, V-shaped"}[schedules.SCHEDULES[name][0]]
    r, dp = _rank(options), options.get("dp")
    out = [*common.ac_lines(case, options),  # activation checkpointing before the stages take the layers
           f"cuts = {cuts!r}  # stage s: model.layers[cuts[s]:cuts[s + 1]]",
           f"on = {ranks!r}  # the {'pp ' * bool(dp)}rank of each stage ({style}, as Schedule{name} places them)"]
    part = "model.layers[cuts[s]:cuts[s + 1]]"
    if case.model.factory == "decoder":  # torchtitan's split: the embedding on the first stage, norm and head on the last
        out[0] = f"cuts = {cuts!r}  # stage s: the blocks cuts[s]..cuts[s + 1] - 1"
        out += ["class Stage(nn.Module):  # the decoder's part of stage s",
                "    def __init__(self, s):",
                "        super().__init__()",
                "        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(cuts[s], cuts[s + 1])})",
                f"        self.first, self.last = s == 0, s == {n - 1}",
                "        if self.first:",
                "            self.tok_embeddings = model.tok_embeddings",
                "        if self.last:",
                "            self.norm, self.output = model.norm, model.output",
                "    def forward(self, x):",
                "        x = self.tok_embeddings(x) if self.first else x",
                "        for block in self.layers.values():",
                "            x = block(x)",
                "        return self.output(self.norm(x)) if self.last else x"]
        part = "Stage(s)"
    elif case.model.buffer:  # the output scale after the last stage's layers, as the model's forward
        out += ["class Scaled(nn.Sequential):  # the last stage: its layers, then the model's output scale",
                "    def forward(self, x):", "        return super().forward(x) * model.scale"]
        head = ", model.head" if case.model.tie_head else ""
        part = f"({part} if s < {n - 1} else Scaled(*model.layers[cuts[s]:]{head}))"
    elif case.model.tie_head:  # the tied head after the last stage's layers
        part = f"({part} if s < {n - 1} else nn.Sequential(*model.layers[cuts[s]:], model.head))"
    if dp:  # torchtitan's composition: each stage fully_shard-ed over dp, the pipeline over this dp index's pp ranks
        layer = "model.layers[str(i)]" if case.model.factory == "decoder" else "model.layers[i]"
        kw = f"mesh=mesh[\"d1\"], reshard_after_forward={bool(options.get('reshard_after_forward'))}"
        wrap = [int(f.split(".")[1]) for f in options.get("wrap", ())]
        out = ["mesh = MESH  # [pp, dp]",
               "pp_group, pp_rank, dp_rank = mesh.get_group(\"d0\"), mesh.get_local_rank(\"d0\"), mesh.get_local_rank(\"d1\")",
               *out, "stages = []", f"for s in range({n}):", "    if on[s] == pp_rank:", f"        stage = {part}"]
        if wrap:
            out += [f"        for i in {wrap!r}:  # the layers with their own fully_shard, then the stage's",
                    "            if cuts[s] <= i < cuts[s + 1]:", f"                fully_shard({layer}, {kw})"]
        out += [f"        fully_shard(stage, {kw})", f"        stages.append(PipelineStage(stage, s, {n}, device, group=pp_group))"]
    else:
        out += [f"stages = [PipelineStage({part}, s, {n}, device) for s in range({n}) if on[s] == rank]"]
    out += [f"def loss_fn(out, y):  # each microbatch's loss",
            f"    return {common.loss(case, 'out', 'y')}"]
    kw = f"n_microbatches={options['n_microbatches']}, loss_fn=loss_fn, scale_grads={bool(options.get('scale_grads'))}"
    out.append(f"schedule = Schedule{name}({'stages' if schedules.is_multi(name) else 'stages[0]'}, {kw})")
    mine = "any(q is p for st in stages for p in st.submod.parameters())"
    if case.model.unused:  # never called: in no stage, on the last stage's rank
        mine += f" or n.startswith(\"unused.\") and {r} == {ranks[-1]}"
    out.append(f"own = {{n: q for n, q in model.named_parameters() if {mine}}}  # this rank's params")
    if schedules.tie_span(case) == "ranks":  # Megatron-LM's embedding group: the first and the last stage's ranks
        out.append(f"tie_group = dist.new_group([{ranks[0]}, {ranks[-1]}])  # the tied weight's two ranks")
    return out


def _per_rank(values: list) -> str:
    """``[v0, v1, ...][rank]``, or ``v0`` where every rank's is the same."""
    if all(v == values[0] for v in values):
        return repr(values[0])
    return f"{values!r}[RANK]"


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    cls, kw = common.optim_class(case), common.kwargs(case, case.optim.kwargs, lr_scale)
    groups, held = case.groups, kept(case, options)
    pick = "(n, own[n])" if case.optim.named else "own[n]"
    if len(groups) == 1 and not groups[0].overrides and set(groups[0].params) == set(param_shapes(case.model)) \
            and all(owned(case, options)) and not case.optim.named:
        return ["kept = [0]  # the case's one group, over this rank's params",
                f"opt = {cls}({', '.join(['list(own.values())', *kw])})"]
    literal = "[" + ", ".join(f"({list(g.params)!r}, {_overrides(case, g.overrides, lr_scale)})" for g in groups) + "]"
    return [f"groups = [{{\"params\": [{pick} for n in names if n in own], **kw}} for names, kw in {literal}]",
            f"kept = {_per_rank(held).replace('RANK', _rank(options))}  # the case's groups this rank holds (none of its params: left out)",
            f"opt = {cls}({', '.join(['[groups[i] for i in kept]', *kw])})"]


def _overrides(case: Case, overrides: dict, lr_scale: float) -> str:
    """A group's own hyperparameters as a dict literal (common.kwargs' ``k=v``, as ``"k": v``)."""
    items = [kv.split("=", 1) for kv in common.kwargs(case, overrides, lr_scale, all_keys=True)]
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in items) + "}"


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    losses = ", losses=losses" if _plateau(case) else ""  # (the last stage's microbatch losses: ReduceLROnPlateau's)
    accum, dp, r = options.get("accum", 1), options.get("dp"), _rank(options)
    x, y = ("xd", "yd") if dp else ("x", "y")
    out = [f"xd, yd = x.tensor_split({dp})[dp_rank], y.tensor_split({dp})[dp_rank]  # this dp rank's slice"] * bool(dp)
    if accum > 1:  # gradient accumulation: a schedule step on each equal part, their grads adding up in p.grad
        return out + ["steps = []  # each step's microbatch losses (the last stage's)"] * bool(losses) + [
            f"for xa, ya in zip({x}.tensor_split({accum}), {y}.tensor_split({accum})):  # accum: {accum} schedule steps",
            "    losses = []" if losses else "    # (the inputs on the first stage's rank, the targets everywhere)",
            f"    if {r} == 0:", f"        schedule.step(xa, target=ya{losses})", "    else:",
            f"        schedule.step(target=ya{losses})"] + ["    steps.append(losses)"] * bool(losses) \
            + _tie_reduce(case, options)
    return out + ["losses = []"] * bool(losses) + [
        f"if {r} == 0:  # the schedule's step: the inputs on the first stage's rank, the targets everywhere",
        f"    schedule.step({x}, target={y}{losses})", "else:", f"    schedule.step(target={y}{losses})"] \
        + _tie_reduce(case, options)


def _tie_reduce(case: Case, options: dict) -> list[str]:
    """A tie across ranks: the tied weight's grad summed over the first and the last stage's ranks (each holds its
    use's part) before the step, as Megatron-LM all-reduces the word embeddings' grads."""
    if schedules.tie_span(case) != "ranks":
        return []
    ranks, w = _layout(case, options)[1], tie_uses(case.model)[0] + ".weight"
    return [f"if {_rank(options)} in ({ranks[0]}, {ranks[-1]}) and own[{w!r}].grad is not None:  # the embedding's "
            "use + the head's", f"    dist.all_reduce(own[{w!r}].grad, group=tie_group)"]


def _plateau(case: Case) -> bool:
    return bool(case.lr_scheduler) and case.lr_scheduler.name == "ReduceLROnPlateau"


def global_loss(case: Case, world: int) -> list[str]:
    """``full_loss``, as the kernel's pp target reports the step's loss: the last stage's microbatch losses summed
    in float64 (their mean with scale_grads) on its rank, sent to every rank, in the case's dtype."""
    last, o = schedules.stage_ranks(case.target_options, world)[-1], case.target_options
    r, dp = _rank(o), o.get("dp")
    send = [f"dist.broadcast(full_loss, group_src={last}, group=pp_group)",  # over dp: the slices' mean
            "dist.all_reduce(full_loss, group=mesh.get_group(\"d1\"))", f"full_loss = full_loss / {dp}"] if dp \
        else [f"dist.broadcast(full_loss, src={last})"]
    scale = f" / {o['n_microbatches']}" if o.get("scale_grads") else ""
    if o.get("accum", 1) > 1:  # each step's losses added to the earlier steps' objective, as the grads accumulate
        return ["full_loss = torch.zeros((), dtype=torch.float64)  # the step's loss: the last stage's, sent to every rank",
                f"if {r} == {last}:", "    for i, losses in enumerate(steps):",
                "        t = [v.detach().double() for v in losses]",
                "        t[0] = t[0] + full_loss if i else t[0]",
                f"        full_loss = sum(t[1:], t[0]){scale}", *send,
                f"full_loss = float(full_loss.to(torch.{case.dtype}))"]
    total = "sum(t.detach().double() for t in losses)" + scale
    return ["full_loss = torch.zeros((), dtype=torch.float64)  # the step's loss: the last stage's, sent to every rank",
            f"if {r} == {last}:", f"    full_loss = {total}", *send,
            f"full_loss = float(full_loss.to(torch.{case.dtype}))"]


def objective(case: Case, net: str, x: str) -> str:
    """The plain model on the schedule's microbatches (tensor_split, as the schedule splits the batch): the sum of
    their losses, their mean with scale_grads (kernel/targets/pp/schedules.py pp_objective); with accum, each step's on its
    equal part; over dp, the mean of each dp rank's slice's."""
    dp = case.target_options.get("dp")
    if dp:
        return f"(sum({_objective(case, net, 'xs', 'ys')} for xs, ys in zip({x}.tensor_split({dp}), y.tensor_split({dp}))) / {dp})"
    return _objective(case, net, x, "y")


def _objective(case: Case, net: str, x: str, y: str) -> str:
    o = case.target_options
    n, accum = o["n_microbatches"], o.get("accum", 1)
    if accum > 1:  # step a of accum counts 1 / n^(accum - a) with scale_grads: each step divides the whole grad
        part = common.loss(case, f"{net}(xa)", "ya") if n == 1 else \
            f"sum({common.loss(case, f'{net}(xm)', 'ym')} for xm, ym in zip(xa.tensor_split({n}), ya.tensor_split({n})))"
        parts = f"zip({x}.tensor_split({accum}), {y}.tensor_split({accum}))"
        if o.get("scale_grads"):
            return f"sum({part} / {n} ** ({accum} - a) for a, (xa, ya) in enumerate({parts}))"
        return f"sum({part} for xa, ya in {parts})"
    if n == 1:  # one microbatch: the whole batch (its mean, with scale_grads, is itself)
        return common.loss(case, f"{net}({x})", y)
    loss = common.loss(case, f"{net}(xm)", "ym")
    total = f"sum({loss} for xm, ym in zip({x}.tensor_split({n}), {y}.tensor_split({n})))"
    return f"({total} / {n})" if o.get("scale_grads") else total


SNAPSHOT = [
    "def gather(mine):  # {key: tensor} of every rank's own, merged on every rank (each param lives on one rank)",
    "    parts = [None] * dist.get_world_size()",
    "    dist.all_gather_object(parts, {k: v if v is None else v.detach().clone() for k, v in mine.items()})",
    "    return {k: v for part in parts for k, v in part.items()}",
    "",
    "def snapshot(net, opt):  # params, optimizer state by (param, name), param groups (the pipeline's: gathered)",
    "    name, piped = {q: n for n, q in net.named_parameters()}, net is model",
    "    params = {n: q.detach().clone() for n, q in net.named_parameters() if not piped or n in own}",
    "    state = {(name[q], k): torch.as_tensor(v).clone() for g in opt.param_groups for q in g[\"params\"]",
    "             for k, v in opt.state.get(q, {}).items()}",
    "    hp = [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()",
    "           if k not in (\"params\", \"param_names\")} for g in opt.param_groups]",
    "    return (gather(params), gather(state), in_case_order(hp)) if piped else (params, state, hp)",
    "",
    "def in_case_order(values):  # one value per group of this rank's optimizer -> one per case group, each from the",
    "    held = [None] * dist.get_world_size()  # lowest rank that holds its params, else from one that holds it empty",
    "    dist.all_gather_object(held, [(i, bool(g[\"params\"]), v) for i, g, v in zip(kept, opt.param_groups, values)])",
    "    first = {}",
    "    for has in (True, False):",
    "        for i, _, v in (t for part in held for t in part if t[1] == has):",
    "            first.setdefault(i, v)",
    "    return [first[i] for i in sorted(first)]"]


# FSDP2's sharded params, grads and state made whole before they are gathered (a collective over dp, in the
# same order on each rank of a dp group: the same stages)
FULL = ["def full(t):  # FSDP2's shards, whole (over dp)", "    return t.full_tensor() if isinstance(t, DTensor) else t", ""]


def snapshot(case: Case, options: dict) -> list[str] | None:
    if not options.get("dp"):
        return SNAPSHOT
    return FULL + [ln.replace("q.detach().clone() for n, q in net.named_parameters()",
                              "full(q.detach()).clone() for n, q in net.named_parameters()")
                   .replace("torch.as_tensor(v).clone() for g in", "full(torch.as_tensor(v)).clone() for g in")
                   for ln in SNAPSHOT]


def grads(case: Case, options: dict) -> str | None:
    if options.get("dp"):
        return "gather({n: None if q.grad is None else full(q.grad) for n, q in own.items()})"
    return "gather({n: q.grad for n, q in own.items()})"


# ---- the checkpoint (kernel/targets/pp/checkpoint.py save / load): torchtitan's, each rank its own model part and optimizer,
# by plain FQN (the optimizer state dict flattened: one key per param and state), in one DCP checkpoint ----

def imports_dcp(case: Case) -> list[str]:
    ck = case.checkpoint
    names = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict"] + \
        (["set_model_state_dict", "set_optimizer_state_dict"] if ck.split else ["set_state_dict"])
    return ["import torch.distributed.checkpoint as dcp",
            f"from torch.distributed.checkpoint.state_dict import {', '.join(names)}"] + \
        ["from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions"] * \
        (ck.async_save in ("stager", "pinned"))


def _part(case: Case, options: dict) -> list[str]:
    """``part``: this rank's model part as the kernel saves and loads it (its stages' layers, the decoder's ends,
    ``unused`` and the output scale on the last stage's rank), under the plain FQNs."""
    r, last = _rank(options), _layout(case, options)[1][-1]
    layer = "model.layers[str(i)]" if case.model.factory == "decoder" else "model.layers[i]"
    out = ["part = nn.Module()  # this rank's model part, as torchtitan saves it: its stages' layers, plain FQNs",
           f"part.layers = nn.ModuleDict({{str(i): {layer} for s, at in enumerate(on) if at == {r} "
           "for i in range(cuts[s], cuts[s + 1])})"]
    ends = (["part.unused = model.unused"] * case.model.unused + ["part.register_buffer(\"scale\", model.scale)"]
            * case.model.buffer + ["part.norm, part.output = model.norm, model.output"] * (case.model.factory == "decoder"))
    out += [f"if {r} == {last}:  # the last stage's", *common.indent(ends)] if ends else []
    if case.model.factory == "decoder":
        out += [f"if {r} == on[0]:", "    part.tok_embeddings = model.tok_embeddings"]
    return out + ["FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # one key per param and state: each stage's own"]


def save_dcp(case: Case, group: str) -> list[str]:
    from . import dsd

    pg = f", process_group={group}" if group else ""
    make = ["sd = {\"model\": get_model_state_dict(part), \"optim\": get_optimizer_state_dict(part, opt, options=FLAT)}"]
    if case.checkpoint.async_save:
        return _part(case, case.target_options) + dsd.async_save(case, pg, make)
    return _part(case, case.target_options) + make + [f"dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt){pg})"]


def load_dcp(case: Case, group: str) -> list[str]:
    from . import dsd

    ck = case.checkpoint
    pg = f", process_group={group}" if group else ""
    out = _part(case, ck.target_options) + [
        "sd = {\"model\": get_model_state_dict(part), \"optim\": get_optimizer_state_dict(part, opt, options=FLAT)}"
        "  # the layout to load into"]
    missing = dsd.missing_keys(case)
    if missing:
        out.append(f"sd[\"model\"] = {{k: v for k, v in sd[\"model\"].items() if k not in {missing!r}}}  # the model "
                   "state dict lacks these")
    out.append(f"dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt){pg})")
    if ck.unexpected:
        out.append("sd[\"model\"][\"fuzzshard_unexpected.weight\"] = torch.zeros(2)  # a key the model has not")
    opts = "StateDictOptions(flatten_optimizer_state_dict=True" + ", strict=False" * (not ck.strict) + ")"
    if ck.split:
        return out + [f"set_model_state_dict(part, sd[\"model\"], options={opts})",
                      f"set_optimizer_state_dict(part, opt, sd[\"optim\"], options={opts})"]
    return out + [f"set_state_dict(part, opt, model_state_dict=sd[\"model\"], optim_state_dict=sd[\"optim\"], "
                  f"options={opts})"]
