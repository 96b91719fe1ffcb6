"""ep: expert parallelism as torchtitan's ``ExpertParallel`` (each MoE's experts Shard(0) over the ep mesh dim,
the routed tokens dispatched and combined with ``all_to_all_single_autograd``, uneven splits, through
``distribute_module``'s input_fn / output_fn) and FSDP2 for the rest (1-D: the experts left out; 2-D [dp, ep]:
the experts ``fully_shard``ed over dp, the rest HSDP), every reduction a sum divided by the dp degree; each rank
trains on its slice of the batch."""
from __future__ import annotations

from ..case import Case
from . import common
from .dtensor import SNAPSHOT

KINDS: dict = {}  # (ep draws no checkpoint)
LOOP = True  # its scripts write the training loop around the step (loop.py)
DTENSOR_GRADS = True  # its grads are DTensors: a total norm over them is one
FREEZE_BEFORE_SHARD = False
MOE = True  # it writes the case's MoE layers (common.py's MoE class)
_OPTIONS = {"wrap", "reshard_after_forward"}

# torchtitan's ExpertParallel (kernel/targets/ep.py), its dispatch and combine
_EP = [
    "class ExpertParallel:  # torchtitan's: the experts Shard(0) over the ep mesh, the tokens sent by all-to-all",
    "    def partition(self, name, mod, mesh):",
    "        [mod.register_parameter(n, nn.Parameter(distribute_tensor(q, mesh, [Shard(0)]))) for n, q in list(mod.named_parameters())]",
    "    def dispatch(self, mod, inputs, mesh):  # the counts exchanged first, then the tokens (uneven splits)",
    "        (x, counts), ep, group = inputs, mesh.shape[0], mesh.get_group()",
    "        got = torch.ops._c10d_functional.wait_tensor(funcol.all_to_all_single(counts, None, None, group=group))",
    "        self.ins, self.outs = counts.view(ep, -1).sum(1).tolist(), got.view(ep, -1).sum(1).tolist()",
    "        lens = got.view(ep, -1).t().reshape(-1)  # rank-major -> expert-major order",
    "        starts, seg = (got.cumsum(0) - got).view(ep, -1).t().reshape(-1), torch.arange(lens.numel()).repeat_interleave(lens)",
    "        self.perm, self.shape = starts[seg] + torch.arange(int(got.sum())) - (lens.cumsum(0) - lens)[seg], (sum(self.outs), x.shape[1])",
    "        return funcol.all_to_all_single_autograd(x, self.outs, self.ins, group)[self.perm], got.view(ep, -1).sum(0)",
    "    def combine(self, mod, out, mesh):  # back to the tokens' ranks",
    "        return funcol.all_to_all_single_autograd(out.new_empty(self.shape).index_put((self.perm,), out), self.ins, self.outs, mesh.get_group())"]


def unsupported(case: Case, options: dict) -> str | None:
    extra = set(options) - _OPTIONS
    if extra:
        return f"options {sorted(extra)}"
    if any(u.endswith("shared_experts") for u in options.get("wrap", ())):
        return "a shared expert with a fully_shard of its own (the script's shared expert has no forward)"
    return None


def imports(case: Case, options: dict) -> list[str]:
    return ["import math", "from torch.distributed import _functional_collectives as funcol",
            "from torch.distributed.device_mesh import init_device_mesh", "from torch.distributed.fsdp import fully_shard",
            "from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor"]


def _module(fqn: str) -> str:
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in fqn.split("."))


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    two = len(shape) == 2
    kw = "" if options.get("reshard_after_forward", True) is True else \
        f", reshard_after_forward={options['reshard_after_forward']!r}"
    ep_mesh = 'mesh["d1"]' if two else "mesh"
    out = _EP + [f"mesh = {mesh}", "for m in (moes := [m for m in model.modules() if isinstance(m, MoE)]):",
                 f"    ep = ExpertParallel(); distribute_module(m.experts, {ep_mesh}, ep.partition, ep.dispatch, ep.combine)",
                 "experts = {q for m in moes for q in m.experts.parameters()}"]
    units = ["*[fully_shard(m.experts, mesh=mesh[\"d0\"]%s) for m in moes]" % kw] if two else []
    units += [f"fully_shard({_module(u)}, mesh=mesh{kw})" for u in
              sorted(options.get("wrap", []), key=lambda n: (-n.count("."), n))]
    units.append(f"fully_shard(model, mesh=mesh{kw}{'' if two else ', ignored_params=experts'})")
    out += [f"for u in [{', '.join(units)}]:  # every reduction a sum, then / the dp degree (gloo: no PREMUL_SUM)",
            f"    u.set_gradient_divide_factor({float(case.world_size)}); u.set_force_sum_reduction_for_comms(True)"]
    if not two:
        out.append(f"[q.register_hook(lambda g: g / {case.world_size}) for q in experts]  # averaged, outside FSDP")
    return out


def optimizer(case: Case, options: dict, lr_scale: float, group: str) -> list[str]:
    return common.optimizer(case, lr_scale)


def global_loss(case: Case, world: int) -> list[str]:
    return ["full_loss = loss.detach().double()", "dist.all_reduce(full_loss)  # the mean over the ranks' slices",
            f"full_loss = float((full_loss / {world}).to(torch.{case.dtype}))"]


def forward_backward(case: Case, options: dict, world: int, shape: tuple) -> list[str]:
    per = case.batch // world
    out = [f"x, y = x[{per} * rank:{per} * rank + {per}], y[{per} * rank:{per} * rank + {per}]  # this rank's slice"
           if world > 1 else "# one rank: the whole batch"]
    return out + [f"loss = {common.loss(case, 'model(x)', 'y')}", "loss.backward()"]


def snapshot(case: Case, options: dict) -> list[str] | None:
    return SNAPSHOT


def grads(case: Case, options: dict) -> str | None:
    return "{n: None if q.grad is None else q.grad.full_tensor().clone() for n, q in model.named_parameters()}"
