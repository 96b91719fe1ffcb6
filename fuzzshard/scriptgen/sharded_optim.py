"""sharded_optim: ``shard_parameter`` (ChunkShardingSpec on a dim, over the
case's ranks in chunk order) and ``ShardedOptimizer``. ShardedTensor has no
autograd: the forward runs on copies gathered with ``ShardedTensor.gather``
and each local shard takes its slice of the full grad, as the kernel does."""
from __future__ import annotations

from ..case import Case
from . import common
from .fsdp2 import module

KINDS = ()
FREEZE_BEFORE_SHARD = False
GROUP = True
REPLICAS = ("param",)  # a replica finding's quantities its snapshot holds (not the per-shard state, nor groups)


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - {"shard"}
    return f"options {sorted(extra)}" if extra else None


def imports(case: Case, options: dict) -> list[str]:
    return ["from torch.distributed._shard.api import shard_parameter",
            "from torch.distributed._shard.sharding_spec import ChunkShardingSpec",
            "from torch.distributed._shard.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor",
            "from torch.distributed._shard.sharded_tensor import ShardedTensor"]


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    out = common.ac_lines(case, options)  # before shard_parameter, as the kernel
    pg = f", process_group={group}" if group else ""
    for fqn, spec in sorted(options.get("shard", {}).items()):
        owner, _, attr = fqn.rpartition(".")
        places = [f"rank:{r}/cpu" if case.device == "cpu" else f"rank:{r}/cuda:{r}" for r in spec["ranks"]]
        out.append(f"shard_parameter({module(owner, case)}, {attr!r}, ChunkShardingSpec({spec['dim']}, {places!r}){pg})")
    return out + _FULL


_FULL = ["def full(t):  # a ShardedTensor gathered to rank 0 and broadcast; its shards must hold the same values",
         "    if not isinstance(t, ShardedTensor):", "        return t.detach().clone()",
         "    out, held = torch.empty(t.size(), dtype=t.dtype, device=device), torch.zeros(t.size(), dtype=t.dtype, device=device)",
         "    t.gather(dst=0, out=out if rank == 0 else None)", "    dist.broadcast(out, src=0)",
         "    for s in t.local_shards():",
         "        held[tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))] = s.tensor.detach()",
         "    dist.all_reduce(held)  # (each element is in one shard)",
         "    assert torch.equal(out, held), f\"ShardedTensor.gather returns {out.tolist()}, its shards hold {held.tolist()}\"",
         "    return out"]


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    (g,) = case.groups  # ShardedOptimizer takes one flat set of params
    kw = common.kwargs(case, {**case.optim.kwargs, **g.overrides}, lr_scale)
    return ["p = dict(named_params_with_sharded_tensor(model))",
            f"opt = ShardedOptimizer({{n: p[n] for n in {list(g.params)!r}}}, {common.optim_class(case)}"
            + "".join(f", {k}" for k in kw) + ")"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    return ["sharded = {n: q for n, q in model.named_parameters() if isinstance(q, ShardedTensor)}",
            "copies = {n: full(q).requires_grad_(q.requires_grad) for n, q in sharded.items()}",
            *([f"loss = {common.loss(case, 'torch.func.functional_call(model, copies, (x,))', 'y')}", "loss.backward()"]
              if not options.get("ac") else
              ["with torch.nn.utils.stateless._reparametrize_module(model, copies):  # the copies, also for the recompute",
               f"    loss = {common.loss(case, 'model(x)', 'y')}", "    loss.backward()"]),
            "for n, q in sharded.items():  # each local shard: its slice of the full grad",
            "    for s in q.local_shards() if copies[n].grad is not None else []:",
            "        part = copies[n].grad[tuple(slice(o, o + m) for o, m in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))].clone()",
            "        s.tensor.grad = part if s.tensor.grad is None else s.tensor.grad.add_(part)"]


def snapshot(case: Case, options: dict) -> list[str] | None:
    return ["def snapshot(model, opt):  # full params (optimizer state: per shard, not compared here)",
            "    return {n: full(q) for n, q in model.named_parameters()}, {}, []"]


def grads(case: Case, options: dict) -> str | None:
    return None
