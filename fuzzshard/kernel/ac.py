"""Activation checkpointing, said once for every target: the drawn spec in a case's ``target_options``, the
rule of what torch supports, and how it is applied to a model.

The spec: ``ac``, the plain FQNs of the modules checkpointed (each one's forward is recomputed in backward),
and ``ac_how``, how (AC_HOWS). fsdp2's first spelling stays: ``ac`` without ``ac_how`` is the composable
``checkpoint`` (or, with ``ac_wrapper``, ``apply_activation_checkpointing``'s non-reentrant wrapper).
A target says which hows it takes in its Spec (``ac``) and calls ``apply`` where its sharding puts it
(fsdp2, zero, ddp, dtensor, tp, pp, sharded_optim: before or after their wrapping as each module's doc says).
The reference trains the same model without any checkpointing: the recomputation must give the grads
the plain forward gives, bit for bit where the ops are deterministic (each op recomputed on the same
inputs), so the sharded run's tolerances stay what they were.
"""
from __future__ import annotations

import functools
import re
import types

import torch
import torch.nn as nn

from .model import param_shapes, submodule

# how a module is checkpointed (draw order: the first is where a drawn case shrinks to); the wrapper forms put a
# CheckpointWrapper in between (AC_WRAPPED), the others keep the module where it was
AC_HOWS = {
    "utils": "torch.utils.checkpoint.checkpoint(forward, use_reentrant=False) as the module's forward",
    "composable": "torch.distributed._composable.checkpoint(module)",
    "wrapper": "apply_activation_checkpointing(checkpoint_wrapper, CheckpointImpl.NO_REENTRANT)",
    "sac": "torch.utils.checkpoint.checkpoint(forward, use_reentrant=False, context_fn=...) with torchtitan's per-op "
           "selective policy (create_selective_checkpoint_contexts: the partitioner's compute-intensive ops and "
           "max saved, every second mm recomputed, the rest recomputed)",
    "utils_reentrant": "torch.utils.checkpoint.checkpoint(forward, use_reentrant=True) as the module's forward",
    "wrapper_reentrant": "checkpoint_wrapper(module, CheckpointImpl.REENTRANT) in its parent",
}
# the reentrant forms give a checkpointed module's params grads only where some input requires grad
# (torch.utils.checkpoint's docs), and support no torch.autograd.grad (pipelining's split backward)
AC_REENTRANT = ("utils_reentrant", "wrapper_reentrant")
AC_WRAPPED = ("wrapper", "wrapper_reentrant")
AC_NON_REENTRANT = tuple(h for h in AC_HOWS if h not in AC_REENTRANT)
_AC_BLOCK = re.compile(r"^layers\.(\d+)$")


def ac_how(options: dict) -> str:
    """The options' checkpointing form ("" where none)."""
    if not options.get("ac"):
        return ""
    return options.get("ac_how") or ("wrapper" if options.get("ac_wrapper") else "composable")


def ac_uses(case) -> bool:
    """Whether either side of ``case`` checkpoints any module."""
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    return any(ac_how(o) for o in sides)


def ac_candidates(shapes: dict) -> list[str]:
    """The modules a case may checkpoint: every module that owns a param below the root (``layers.i`` and
    deeper; fsdp2's owners), in FQN order."""
    return sorted({".".join(n.split(".")[:i]) for n in shapes for i in range(2, n.count(".") + 1)})


def ac_blocks(shapes: dict) -> list[str]:
    """The top-level blocks (``layers.i``, in order), what per-layer AC counts every k-th of."""
    return sorted({m for m in ac_candidates(shapes) if _AC_BLOCK.match(m)}, key=lambda m: int(m.split(".")[1]))


def _ac_always_trainable(case) -> set[str]:
    """The params that require grad in every step: not frozen at the start nor by any step."""
    frozen = set(case.frozen) | {n for s in case.schedule for n in s.freeze}
    return {n for n in param_shapes(case.model) if n not in frozen}


def ac_reentrant_problem(case, fqn: str) -> str | None:
    """Why reentrant checkpointing of ``fqn`` would leave its params without grads in this case (None: it
    would not). torch.utils.checkpoint: "At least one input and output must have requires_grad=True for the
    reentrant variant of checkpoint, otherwise the checkpointed part of the model won't have gradients" (a
    documented difference from the plain model: not drawn). Taken only where it is sure: a top-level block
    ``layers.i`` (i >= 1) of a drawn topology, after a block holding a param that trains in every step."""
    m = _AC_BLOCK.match(fqn)
    if case.model.factory or not m or int(m.group(1)) == 0:
        return f"reentrant checkpoint of {fqn}: its input need not require grad"
    before = {f"layers.{j}." for j in range(int(m.group(1)))}
    if not any(n[:n.index(".", 7) + 1] in before for n in _ac_always_trainable(case) if n.startswith("layers.")):
        return f"reentrant checkpoint of {fqn}: no block before it trains every step (its input needs grad)"
    return None


def ac_moe_problem(case, spec, fqn: str) -> str | None:
    """Why checkpointing ``fqn`` would break an MoE that runs on full plain copies (None: it would not). Where a
    target's MoE sees DTensor activations (its Spec's ``moe`` "local": dtensor, tp), MoE._forward_local swaps
    plain copies in for the params for its forward only (kernel/moe.py); a module checkpointed inside it
    recomputes in backward, outside that swap, on the DTensor params and a plain input ("aten.mm.default got
    mixed torch.Tensor and DTensor"). Fuzzshard's own path, not torch's: checkpointing the MoE itself (its
    recompute swaps again) or a module around it is drawn, a module strictly inside it is not."""
    if not (spec.moe or {}).get("local"):
        return None
    from .moe import moe_prefixes

    inside = [p for p in moe_prefixes(case.model) if fqn.startswith(p)]
    if inside:
        return (f"activation checkpointing of {fqn}, inside the MoE at {inside[0][:-1]}: {case.target}'s MoE runs "
                f"on full copies swapped in for its forward only, the recompute would see the DTensor params")
    return None


def ac_problem(case, options: dict, spec) -> str | None:
    """Why these AC options are no case of this target (Case.check asks it of either side), or None."""
    h = ac_how(options)
    if options.get("ac_how") and not options.get("ac"):  # (a reduced case drops the form first, then the modules)
        return f"ac_how {options['ac_how']!r} without modules to checkpoint (ac)"
    if not h:
        return None
    if h not in AC_HOWS:
        return f"ac_how {h!r}: one of {', '.join(AC_HOWS)}"
    if h not in (spec.ac or ()):
        return f"activation checkpointing {h!r}: {case.target} draws {', '.join(spec.ac) or 'none'}"
    if spec.ac_rule:
        why = spec.ac_rule(options, h)
        if why:
            return why
    known = set(ac_candidates(param_shapes(case.model)))
    missing = [m for m in options["ac"] if m not in known]
    if missing:
        return f"activation checkpointing of {missing}: no such module owning params"
    for fqn in options["ac"]:
        why = ac_moe_problem(case, spec, fqn)
        if why:
            return why
    if h in AC_REENTRANT:
        for fqn in options["ac"]:
            why = ac_reentrant_problem(case, fqn)
            if why:
                return why
    return None


# torchtitan's SelectiveAC (torchtitan/distributed/activation_checkpoint.py): the compute-intensive ops (the
# partitioner's list: matmuls, convolutions, attention) and max saved, every second mm (or linear) recomputed,
# everything else recomputed (torchtitan's attention and reduce-scatter ops left out: the models here run none
# of them outside the partitioner's list). The script writes the same set (scriptgen/common.py: _SAC) less the
# MoE's two below: a script's MoE recomputes its topk to the same values (deterministic on the same inputs, saved
# or not), and ep's script, the one with all-to-alls, falls back under selective AC (past 150 lines)


def _sac_save_ops() -> set:
    from torch._functorch.partitioners import get_default_op_list

    # torchtitan's MoE saves: the routing's topk (its expert assignment kept between forward and recompute) and
    # EP's token dispatch and combine all-to-alls (not communicated again in the recompute)
    moe = {torch.ops.aten.topk.default, torch.ops._c10d_functional.all_to_all_single.default}
    return {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.linear.default, torch.ops.aten.max.default} | moe |\
        {op.default for op in get_default_op_list().compute_intensive_ops}


def sac_policy():
    """A fresh per-op policy (its mm counters are per checkpointed call, forward and recompute apart)."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = _sac_save_ops()
    mm = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func in mm:
            meta[key] += 1
        if func in save:
            if func in mm and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(sac_policy())


def _checkpointed_forward(self, *args, **kwargs):
    """A module's forward under torch.utils.checkpoint (bound to the module: a deepcopy rebinds it), with
    selective AC's context where drawn."""
    from torch.utils.checkpoint import checkpoint

    extra = {"context_fn": sac_context} if self._fuzzshard_ac == "sac" else {}
    return checkpoint(functools.partial(type(self).forward, self), *args,
                      use_reentrant=self._fuzzshard_ac == "utils_reentrant", **extra, **kwargs)


def _ac_locate(model: nn.Module, fqn: str) -> tuple[nn.Module, str, nn.Module]:
    """(parent, child name, module) of a plain FQN, wrappers on the way answered for the module they wrap."""
    parent_fqn, _, name = fqn.rpartition(".")
    parent = submodule(model, parent_fqn)
    while name not in parent._modules:  # a wrapper in between (FSDP1's unit)
        parent = next(iter(parent._modules.values()))
    return parent, name, parent._modules[name]


def apply_ac(model: nn.Module, options: dict) -> nn.Module:
    """Checkpoint the options' modules of ``model``, in place, as ``how`` says; returns ``model``. A wrapper
    form puts a CheckpointWrapper in between (its FQNs gain ``_checkpoint_wrapped_module``, which
    ``named_params`` and ``submodule`` leave out)."""
    h = ac_how(options)
    if not h:
        return model
    fqns = list(options["ac"])
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    if h == "wrapper":  # one call over the whole model, its check_fn picking the modules
        chosen = {id(_ac_locate(model, f)[2]) for f in fqns}
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: id(m) in chosen)
        return model
    # deepest first, so a parent's wrapper wraps a child already wrapped
    for fqn in sorted(fqns, key=lambda n: (-n.count("."), n)):
        parent, name, module = _ac_locate(model, fqn)
        if h == "composable":
            from torch.distributed._composable import checkpoint

            checkpoint(module)
        elif h in ("utils", "utils_reentrant", "sac"):
            module._fuzzshard_ac = h
            module.forward = types.MethodType(_checkpointed_forward, module)
        elif h == "wrapper_reentrant":
            parent.register_module(name, checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.REENTRANT))
    return model


def ac_coverage(case) -> dict:
    """{"activation checkpointing": [how, ...]}: the forms a passing case ran (a session's coverage line,
    every target's); {} without AC."""
    sides = [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])
    cells = [ac_how(o) for o in sides if ac_how(o)]
    return {"activation checkpointing": cells} if cells else {}


def ac_describe(options: dict) -> str:
    """``show``'s words: which modules, and how ("" without AC)."""
    h = ac_how(options)
    return f"{', '.join(options['ac'])} under {AC_HOWS[h]}" if h else ""
