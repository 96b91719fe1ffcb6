"""Planted bug: the MoE load-balancing hook updates each rank's routing bias from its own expert counts,
without summing them over the data-parallel ranks (torchtitan's _update_expert_bias without its all-reduce):
each rank's bias drifts its own way. A mutation of the hook fuzzshard carries (kernel/moe.py), not of torch:
the bug a training framework writes around torch."""
import fuzzshard.kernel.moe as moe

_orig = moe.update_expert_bias


def _local_counts(model, groups=()):
    return _orig(model, ())


moe.update_expert_bias = _local_counts
