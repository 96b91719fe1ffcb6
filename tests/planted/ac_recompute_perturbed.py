"""Planted bug: activation checkpointing's recomputation differs from the original forward. Every
checkpointed function that runs again inside backward (the recompute of every form: torch.utils.checkpoint
reentrant or not, checkpoint_wrapper, the composable checkpoint, selective AC) sees its first floating input
scaled by 1.25, so the activations it saves for the backward are not the forward's and the grads inside the
checkpointed region are wrong; the forward and the loss are untouched. A run without AC never meets it."""
import functools

import torch
import torch.distributed._composable.checkpoint_activation as composable
import torch.utils.checkpoint as tuc


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _perturbed(fn, graph: bool):
    """``fn``, whose first floating input is scaled when it runs inside backward: outside any dispatch mode
    (selective AC's records the recomputed ops), and for the reentrant form through the graph (its input's
    grad is what it hands back), for the non-reentrant one out of it (its recompute matches saved tensors)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _in_backward():
            from torch.utils._python_dispatch import _disable_current_modes

            args = list(args)
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    with _disable_current_modes(), torch.set_grad_enabled(graph):
                        args[i] = a * 1.25
                    if not graph:  # a leaf that requires grad as the input did: the same tensors saved
                        args[i].requires_grad_(a.requires_grad)
                    break
        return fn(*args, **kwargs)

    return run


if not getattr(tuc, "_planted_ac", False):
    tuc._planted_ac = True
    generator = tuc._checkpoint_without_reentrant_generator

    def _generator(fn, *rest, **kwargs):  # non-reentrant: fn runs again in backward (recompute_fn)
        return generator(_perturbed(fn, False), *rest, **kwargs)

    tuc._checkpoint_without_reentrant_generator = _generator
    composable._checkpoint_without_reentrant_generator = _generator
    forward = tuc.CheckpointFunction.forward

    def _forward(ctx, run_function, preserve_rng_state, *args):  # reentrant: ctx.run_function in backward
        return forward(ctx, _perturbed(run_function, True), preserve_rng_state, *args)

    tuc.CheckpointFunction.forward = staticmethod(_forward)
