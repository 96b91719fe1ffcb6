"""ep: expert parallelism as torchtitan's ``ExpertParallel`` (each MoE's experts Shard(0) over the ep mesh dim,
the routed tokens dispatched and combined with ``all_to_all_single_autograd``, uneven splits, through
``distribute_module``'s input_fn / output_fn) and FSDP2 for the rest (1-D: the experts left out; 2-D [dp, ep]:
the experts ``fully_shard``ed over dp, the rest HSDP), every reduction a sum divided by the dp degree; each rank
trains on its slice of the batch."""
from __future__ import annotations

import math

from ..case import Case
from ..kernel import ac, dropout
from . import common, dsd
from .dtensor import SNAPSHOT

KINDS = dsd.KINDS  # DSD's state dicts: the experts' params and optimizer state are DTensors on the ep mesh
LOOP = True  # its scripts write the training loop around the step (loop.py)
DTENSOR_GRADS = True  # its grads are DTensors: a total norm over them is one
FREEZE_BEFORE_SHARD = False
MOE = True  # it writes the case's MoE layers (common.py's MoE class)
_OPTIONS = {"wrap", "reshard_after_forward"}

# torchtitan's ExpertParallel (kernel/targets/ep.py), its dispatch and combine; expert_parallel applies it to every MoE
_EP = [
    "class ExpertParallel:  # torchtitan's: the experts Shard(0) over the ep mesh, the tokens sent by all-to-all",
    "    def partition(self, name, mod, mesh):",
    "        [mod.register_parameter(n, nn.Parameter(distribute_tensor(q, mesh, [Shard(0)]))) for n, q in list(mod.named_parameters())]",
    "    def dispatch(self, mod, inputs, mesh):  # the counts exchanged first, then the tokens (uneven splits)",
    "        (x, counts), ep, group = inputs, mesh.shape[0], mesh.get_group()",
    "        got = torch.ops._c10d_functional.wait_tensor(funcol.all_to_all_single(counts, None, None, group=group)).view(ep, -1)",
    "        self.ins, self.outs = counts.view(ep, -1).sum(1).tolist(), got.sum(1).tolist()",
    "        blocks = torch.arange(sum(self.outs)).split(got.reshape(-1).tolist())  # received: rank-major, by expert within",
    "        self.perm = torch.cat([blocks[r * got.shape[1] + e] for e in range(got.shape[1]) for r in range(ep)])  # expert-major",
    "        return funcol.all_to_all_single_autograd(x, self.outs, self.ins, group)[self.perm], got.sum(0)",
    "    def combine(self, mod, out, mesh):  # back to the tokens' ranks",
    "        return funcol.all_to_all_single_autograd(out.new_empty(len(self.perm), out.shape[1]).index_put((self.perm,), out), self.ins, self.outs, mesh.get_group())",
    "def expert_parallel(model, mesh):  # every MoE's experts: ExpertParallel over the ep mesh",
    "    return [distribute_module(m.experts, mesh, (ep := ExpertParallel()).partition, ep.dispatch, ep.combine) for m in model.modules() if isinstance(m, MoE)]"]


def definitions(case: Case) -> list[str]:
    return _EP


def unsupported(case: Case, options: dict) -> str | None:
    if options.get("tp"):
        return "tp (the MoE's TP region: the router's NoParallel, each TP rank's slice of the tokens) not written yet"
    extra = set(options) - _OPTIONS
    if extra:
        return f"options {sorted(extra)}"
    if any(u.endswith("shared_experts") for u in options.get("wrap", ())):
        return "a shared expert with a fully_shard of its own (the script's shared expert has no forward)"
    if dropout.has_dropout(case.model):  # (the kernel's replay: tests/test_ep_ac.py)
        return "dropout (its per-rank seeds and the reference's replay take the ep script past 150 lines)"
    return None


def ac_unsupported(case: Case, options: dict) -> str | None:
    """Selective AC's policy (and the MoE's saved all-to-alls) takes the ep script past 150 lines."""
    if ac.ac_how(options) == "sac":
        return "selective activation checkpointing (its policy and the MoE's saved ops take the ep script past 150 lines)"
    return None


def imports(case: Case, options: dict) -> list[str]:
    return ["import math", "from torch.distributed import _functional_collectives as funcol",
            "from torch.distributed.device_mesh import init_device_mesh", "from torch.distributed.fsdp import fully_shard",
            "from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor"]


def _module(fqn: str) -> str:
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in fqn.split("."))


def shard(case: Case, options: dict, shape: tuple, mesh: str, group: str) -> list[str]:
    two, world = len(shape) == 2, math.prod(shape)  # (this side's: a checkpoint may load on another mesh)
    kw = "" if options.get("reshard_after_forward", True) is True else \
        f", reshard_after_forward={options['reshard_after_forward']!r}"
    out = [f"mesh = {mesh}"] + ([] if two else
                                ["experts = {q for e in expert_parallel(model, mesh) for q in e.parameters()}  # outside FSDP"])
    made = "expert_parallel(model, mesh[\"d1\"])"
    if ac.ac_how(options):  # activation checkpointing after EP, before fully_shard (the kernel's, torchtitan's order)
        out += (["ep_experts = " + made] if two else []) + common.ac_lines(case, options)
        made = "ep_experts" if two else made
    units = ["*[fully_shard(e, mesh=mesh[\"d0\"]%s) for e in %s]" % (kw, made)] if two else []
    units += [f"fully_shard({_module(u)}, mesh=mesh{kw})" for u in
              sorted(options.get("wrap", []), key=lambda n: (-n.count("."), n))]
    units.append(f"fully_shard(model, mesh=mesh{kw}{'' if two else ', ignored_params=experts'})")
    out.append(f"[(u.set_gradient_divide_factor({float(world)}), u.set_force_sum_reduction_for_comms(True)) for u in "
               f"[{', '.join(units)}]]  # each reduction a sum, then / the dp degree (gloo: no PREMUL_SUM)")
    if not two:
        out.append(f"[q.register_hook(lambda g: g / {world}) for q in experts]  # averaged, outside FSDP")
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
