"""fsdp1: ``FullyShardedDataParallel`` (its sharding strategy, use_orig_params,
units through a CustomPolicy, ignored modules, ``device_id=cpu``) and its own
optimizer-state-dict checkpoints: fsdp1_full (FSDP.optim_state_dict under
FULL_STATE_DICT), fsdp1_sharded (SHARDED_STATE_DICT through DCP,
load_sharded_optimizer_state_dict), fsdp1_legacy (full_optim_state_dict and
shard_/scatter_full_optim_state_dict), beside DSD's full/broadcast/dcp."""
from __future__ import annotations

from ..case import Case
from . import common, dsd, sync
from .fsdp2 import module

KINDS = dsd.KINDS + ("fsdp1_full", "fsdp1_sharded", "fsdp1_legacy")
LOOP = True  # its scripts write the training loop around the step (loop.py), as kernel/targets/fsdp1.py runs it:
OWN_CLIP = True  # the clip "own": FSDP1's own model.clip_grad_norm_ (torch.nn.utils' would norm each rank's shard)
SHARDED_SCALER = True  # ShardedGradScaler (found_inf all-reduced: each rank holds only its shard's grads) ...
SCALER_GROUP = "dist.group.WORLD"  # ... over the job's ranks (the kernel's _job_group)
FREEZE_BEFORE_SHARD = True  # FSDP records requires_grad when it flattens
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_OPTIONS = {"strategy", "orig_params", "wrap", "ignored", "osd", "legacy_load", "legacy", "flatten", "local", "microbatches",
            "sync"}


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    if extra:
        return f"options {sorted(extra)}"
    if options.get("local") and case.clip and case.clip.how == "own":
        return "resumed without FSDP (local) with its own clip (torch.nn.utils' on the local model)"
    if options.get("microbatches", 1) > 1 and not options.get("local"):
        from . import loop

        if loop.plateau(case):
            return "ReduceLROnPlateau fed a loss accumulated over microbatches"
    return sync.unsupported(case, options)


def objective(case: Case, net: str, x: str) -> str:
    """The plain replay's loss: under ``sync`` the global objective (kernel/sync.py)."""
    loss = common.loss(case, f"{net}({x})", "y")
    return sync.objective(case, net, x, loss) if case.target_options.get("sync") else loss


def imports(case: Case, options: dict) -> list[str]:
    out = ["from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy"]
    if options.get("microbatches", 1) > 1 and not options.get("local"):
        out.append("import contextlib")
    if options.get("wrap"):
        out.append("from torch.distributed.fsdp.wrap import CustomPolicy")
    if options.get("strategy") in HYBRID:
        out.append("from torch.distributed.device_mesh import init_device_mesh")
    return out


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    if options.get("local"):  # (a loading side) resume without FSDP: the plain model on every rank
        return common.ac_lines(case, options)
    strategy = options.get("strategy", "FULL_SHARD")
    out, kw = [], []
    if strategy != "FULL_SHARD":
        kw.append(f"sharding_strategy=ShardingStrategy.{strategy}")
    if options.get("orig_params", True):
        kw.append("use_orig_params=True")
    if options.get("wrap"):
        out.append(f"units = [{', '.join(module(u, case) for u in options['wrap'])}]  # each its own FSDP unit")
        kw.append("auto_wrap_policy=CustomPolicy(lambda m: any(m is u for u in units))")
    if options.get("ignored"):
        out.append(f"ignored = [{', '.join(module(u, case) for u in options['ignored'])}]  # FSDP leaves these whole")
        kw.append("ignored_states=ignored")
    if strategy in HYBRID:
        out.insert(0, f"mesh = {mesh}")
        kw.append("device_mesh=mesh")
    elif group:
        kw.append(f"process_group={group}")
    kw.append("device_id=device")
    return out + [f"model = FSDP(model, {', '.join(kw)})"] + common.ac_lines(case, options)  # AC after FSDP wraps


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    if options.get("orig_params", True) or options.get("local"):
        return common.optimizer(case, lr_scale, names=common.plain_names())
    o = case.optim  # the flat params, in the one group the case has
    over = common.kwargs(case, case.groups[0].overrides, lr_scale, all_keys=True)
    g = "[{" + ", ".join(["\"params\": list(model.parameters())"] + [f"{e.split('=', 1)[0]!r}: {e.split('=', 1)[1]}"
                                                                     for e in over]) + "}]"
    return [f"opt = {common.optim_class(case)}({', '.join([g, *common.kwargs(case, o.kwargs, lr_scale)])})  # the flat params"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    if options.get("local"):  # the plain model on the whole batch, on every rank (the kernel's local resume)
        return [f"loss = {common.loss(case, 'model(x)', 'y')}", "loss.backward()"]
    per = case.batch // world
    out = [f"x, y = x[{per} * rank:{per} * rank + {per}], y[{per} * rank:{per} * rank + {per}]  # this rank's slice"] \
        if world > 1 else []
    if options.get("sync") or options.get("microbatches", 1) > 1:  # no_sync() on all but the last microbatch
        skip = (options.get("sync") or {}).get("skip", "all") == "all"
        out += sync.weights_line(case, options) if options.get("sync") else []
        out += sync.loop(case, options, lambda last: [], common.loss(case, "model(xm)", "ym"),
                         f"{per} * rank:{per} * rank + {per}" if world > 1 else None,
                         context=(lambda last: f"(contextlib.nullcontext() if {last} else model.no_sync())") if skip else None)
    else:
        out += [f"loss = {common.loss(case, 'model(x)', 'y')}", "loss.backward()"]
    if options.get("ignored") and world > 1:
        out += ["for q in {q for m in ignored for q in m.parameters()}:  # FSDP leaves their grads unreduced",
                "    if q.grad is not None:", "        dist.all_reduce(q.grad)", f"        q.grad.div_({world})"]
    return out


def snapshot(case: Case, options: dict) -> list[str] | None:
    return ["def snapshot(model, opt):  # full copies through FSDP's own APIs: params, optimizer state, param groups",
            "    with FSDP.summon_full_params(model, writeback=False):",
            f"        params = {{n.replace('_fsdp_wrapped_module.', ''): q.detach().clone() for n, q in model.named_parameters()}}",
            "    if isinstance(model, FSDP):",
            "        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(offload_to_cpu=False)):",
            "            osd = FSDP.optim_state_dict(model, opt)[\"state\"]",
            "    else:  # the plain replay's model",
            "        osd = {n: opt.state[q] for n, q in model.named_parameters() if q in opt.state}",
            "    return (params, {(n, k): torch.as_tensor(v).detach().clone() for n, s in osd.items() for k, v in s.items()},",
            "            [{k: v.tolist() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in g.items()",
            "              if k not in (\"params\", \"param_names\")} for g in opt.param_groups])"]


def grads_def(case: Case, options: dict) -> list[str]:
    """What ``grads`` calls, where a script reads the grads."""
    return _GRADS


def snapshot_imports() -> list[str]:
    return ["from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType"]


def grads(case: Case, options: dict) -> str | None:
    if not options.get("orig_params", True):
        return None  # (a flat param's grad has no API: parity goes to the flattened kernel)
    return "full_grads(model)"


# the grads as the optimizer reads them (with orig params), whole: summon shows a frozen param's grad as zeros,
# the optimizer sees None (kernel/targets/fsdp1.py grads)
_GRADS = ["def full_grads(model):  # each param's grad as the optimizer reads it, whole (FSDP's summon_full_params)",
          "    with FSDP.summon_full_params(model, writeback=False, with_grads=True):",
          "        return {n.replace('_fsdp_wrapped_module.', ''): None if q.grad is None or not q.requires_grad",
          "                else q.grad.detach().clone() for n, q in model.named_parameters()}"]


def _full(osd: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(osd.items()) if v)
    # (the optimizer's config offloads by default, the model's does not: the kernel's _full says both)
    optim = ", ".join([f"offload_to_cpu={bool(osd.get('offload_to_cpu'))!r}"] + ["rank0_only=True"] * bool(osd.get("rank0_only")))
    return f"FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig({args}), " \
           f"FullOptimStateDictConfig({optim}))"


def imports_fsdp1_full(case: Case) -> list[str]:
    return ["from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType"] + \
        ["from torch.distributed.fsdp import OptimStateKeyType"] * bool(case.checkpoint.target_options.get("local"))


imports_fsdp1_legacy = imports_fsdp1_full


def imports_fsdp1_sharded(case: Case) -> list[str]:
    return ["import torch.distributed.checkpoint as dcp",
            "from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict",
            "from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType"]


def save_fsdp1_full(case: Case, group: str) -> list[str]:
    return [f"with {_full(case.target_options.get('osd', {}))}:",
            "    msd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)",
            "if rank == 0:", "    torch.save({\"model\": msd, \"optim\": osd}, f\"{ckpt}/full.pt\")"]


def save_fsdp1_legacy(case: Case, group: str) -> list[str]:
    osd = case.target_options.get("osd", {})
    return [f"with {_full(osd)}:", "    msd = model.state_dict()",
            f"osd = FSDP.full_optim_state_dict(model, opt, rank0_only={osd.get('rank0_only', True)!r})",
            "if rank == 0:", "    torch.save({\"model\": msd, \"optim\": osd}, f\"{ckpt}/full.pt\")"]


def load_fsdp1_full(case: Case, group: str) -> list[str]:
    how = case.checkpoint.target_options.get("legacy_load", "shard")
    if case.checkpoint.target_options.get("local"):  # into the plain model: the state re-keyed to the param IDs
        return ["sd = torch.load(f\"{ckpt}/full.pt\", map_location=\"cpu\")", "model.load_state_dict(sd[\"model\"])",
                "opt.load_state_dict(FSDP.rekey_optim_state_dict(sd[\"optim\"], OptimStateKeyType.PARAM_ID, model, optim=opt))"]
    if case.checkpoint.kind == "fsdp1_full":
        osd = "FSDP.optim_state_dict_to_load(model, opt, sd[\"optim\"])"
    elif how == "scatter":
        osd = "FSDP.scatter_full_optim_state_dict(sd[\"optim\"] if rank == 0 else None, model, optim=opt)"
    else:
        osd = "FSDP.shard_full_optim_state_dict(sd[\"optim\"], model, optim=opt)"
    return ["sd = torch.load(f\"{ckpt}/full.pt\", map_location=\"cpu\")", f"with {_full({})}:",
            "    model.load_state_dict(sd[\"model\"])", f"    opt.load_state_dict({osd})"]


load_fsdp1_legacy = load_fsdp1_full

_SHARDED = "FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), " \
           "ShardedOptimStateDictConfig())"


def save_fsdp1_sharded(case: Case, group: str) -> list[str]:
    api = "sharded_optim_state_dict" if case.target_options.get("legacy") else "optim_state_dict"
    pg = f", process_group={group}" if group else ""
    return [f"with {_SHARDED}:", f"    sd = {{\"model\": model.state_dict(), \"optim\": FSDP.{api}(model, opt)}}",
            f"dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt){pg})"]


def load_fsdp1_sharded(case: Case, group: str) -> list[str]:
    pg = f", process_group={group}" if group else ""
    to_load = "FSDP.flatten_sharded_optim_state_dict(osd, model, opt)" if case.checkpoint.target_options.get("flatten") \
        else "FSDP.optim_state_dict_to_load(model, opt, osd)"
    return ["reader = dcp.FileSystemReader(ckpt)", f"with {_SHARDED}:", "    sd = {\"model\": model.state_dict()}",
            f"    dcp.load(sd, storage_reader=reader{pg})", "    model.load_state_dict(sd[\"model\"])",
            "    osd = load_sharded_optimizer_state_dict(model_state_dict=sd[\"model\"], optimizer_key=\"optim\", "
            "storage_reader=reader)[\"optim\"]", f"    opt.load_state_dict({to_load})"]
