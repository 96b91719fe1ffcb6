"""FSDP2 under gradient accumulation reduces a unit the forward calls twice (a twice layer's inner, wrapped) in
two reduce-scatters a step: its later call's post-backward hook runs before autograd has accumulated the
param's grad, so it reduces the earlier microbatches' sum alone, and the earlier call's hook the last
microbatch's grad; both are added to the sharded grad in float32. Under a float16 reduce_dtype the one float16
sum of every microbatch's grad the reference made overflowed where FSDP2's never does (the lead
fsdp2.parity.grad "inf in one run only", a false positive): the reference now splits as FSDP2 does
(kernel/targets/fsdp2.py split_reduced)."""
import dataclasses
import json
from pathlib import Path

from fuzzshard.case import Case
from fuzzshard.kernel.targets.fsdp2 import split_reduced
from fuzzshard.pool.options import PoolOptions
from fuzzshard.pool.runner import Pool

from conftest import PLANTED

# the lead as it was met (tests/test_clean_session.py's fsdp2-RMSprop session): 1 rank, a float16 reduce,
# 2 microbatches, layers.2 a twice block whose first Linear is its own unit; its grads pass 65504 at step 1
LEAD = Case.from_dict(json.loads((Path(__file__).parent / "data" / "fsdp2_twice_fp16_reduce.json").read_text()))
# the same on 2 ranks: the pre-divide (2) and a reduce over ranks, each of the two reductions apart
TWO = dataclasses.replace(LEAD, world_size=2, mesh_shape=(2,), batch=4)
SPLIT = {"layers.2.inner.0.weight", "layers.2.inner.0.bias"}


def test_only_a_twice_called_unit_under_accumulation_is_reduced_apart():
    opts = LEAD.target_options
    assert split_reduced(LEAD, opts) == SPLIT
    assert split_reduced(LEAD, {**opts, "microbatches": 1}) == set()
    assert split_reduced(LEAD, {**opts, "wrap": ["layers.2"]}) == set()  # the Twice itself: called once
    assert split_reduced(LEAD, {**opts, "wrap": ["layers.2.inner"]}) == SPLIT | {"layers.2.inner.1.weight",
                                                                               "layers.2.inner.1.bias"}
    assert split_reduced(LEAD, {**opts, "wrap": []}) == set()  # the root: one post-backward, at the end


def test_a_twice_called_units_float16_reduce_passes_and_an_early_reduce_that_drops_it_is_caught():
    with Pool(2, placed=True, options=PoolOptions(case_timeout=120)) as pool:
        clean = [r.verdict for r in pool.run_many([LEAD, TWO])]
    assert [v.status for v in clean] == ["pass", "pass"], [(v.status, v.first or v.error) for v in clean]
    with Pool(2, placed=True, options=PoolOptions(
            case_timeout=120, setup=(str(PLANTED / "fsdp2_early_reduce_drops_accumulated.py"),))) as pool:
        buggy = [r.verdict for r in pool.run_many([LEAD, TWO])]
    for v in buggy:
        assert v.is_finding and v.oracle == "parity", (v.status, v.first or v.error)
        assert v.first.quantity == "grad" and v.first.fqn in SPLIT and "in one run only" not in v.first.detail, v.first
