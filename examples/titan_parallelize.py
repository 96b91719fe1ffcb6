"""A user's own parallelism, fuzzed from this one file against the unsharded model:

    fuzzshard fuzz --plugin examples/titan_parallelize.py --target titan --world-sizes 1,2,4

``titan`` applies to examples/tiny_llm.py's TinyLLM what torchtitan's
``parallelize_llama`` applies to Llama: on a 2-D mesh, tensor parallelism on
dim "d1" (the embedding row-wise, wq/wk/wv and w1/w3 column-wise, wo and w2
row-wise, the output head column-wise; with sequence parallelism, the norms
``SequenceParallel`` and ``PrepareModuleInput`` where the layout changes),
then activation checkpointing per block, then FSDP2 (``fully_shard``) per
block and on the root over dim "d0". On a 1-D mesh (or a 2-D one without
TP: HSDP) it is FSDP2 alone. The options are drawn per case; TP only where
the head count divides by the TP degree, as torchtitan requires.

TITAN_BUG=rowwise_avg plants a classic TP bug: the feed-forward's row-wise
w2 averages its partial sums over the TP ranks instead of adding them.
fuzzshard finds it, shrinks it to one block, and the repro replays it.
"""
import os
import sys

import hypothesis.strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llm  # noqa: E402  (registers the model this parallelism is written for)

from fuzzshard import plugin  # noqa: E402

PLANTED = os.environ.get("TITAN_BUG") == "rowwise_avg"


def titan(model, mesh, options: dict):
    from torch.distributed.fsdp import fully_shard

    if options.get("tp"):
        apply_tp(model, mesh["d1"], options.get("sp", False))
    if options.get("ac"):
        from torch.distributed._composable import checkpoint

        for block in model.layers.values():
            checkpoint(block)
    dp = mesh["d0"] if options.get("tp") else mesh
    raf = options.get("reshard_after_forward", True)
    for block in model.layers.values():
        fully_shard(block, mesh=dp, reshard_after_forward=raf)
    fully_shard(model, mesh=dp, reshard_after_forward=raf)
    return model


def apply_tp(model, tp_mesh, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sp else Replicate()  # the layout between blocks: sequence-sharded under SP
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": _Averaged(output_layouts=seq) if PLANTED else RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def _Averaged(**kwargs):
    """RowwiseParallel whose output reduction averages over the TP ranks (the planted bug)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class Averaged(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
            return out / device_mesh.size()

    return Averaged(**kwargs)


def options(mesh_shape: tuple, model) -> st.SearchStrategy:
    sizes = getattr(model, "sizes", {}) or {}
    # torchtitan's rule: every dim TP splits divides by the TP degree (heads, MLP width, vocabulary)
    tp_ok = len(mesh_shape) == 2 and all(sizes.get(k, 0) % mesh_shape[1] == 0 for k in ("n_heads", "hidden", "d_in"))
    return st.fixed_dictionaries({
        "tp": st.booleans() if tp_ok else st.just(False),
        "reshard_after_forward": st.booleans(),
        "ac": st.booleans(),
        # sequence parallelism shards the sequence over the TP ranks, and torchtitan keeps the sequence
        # length divisible by the TP degree; the case draws its length after these options, so SP is
        # left to a replayed case's options ("sp": true) rather than drawn
        "sp": st.just(False),
    })


plugin.parallelism(titan, options=options, models=["tiny_llm"])
