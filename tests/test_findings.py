"""Known findings' triggers and the plain-FQN view of wrapped models (no process groups)."""
import dataclasses

import pytest
import torch

from fuzzshard.findings import load_known, triggered
from fuzzshard.kernel.model import named_params, submodule


def test_every_known_trigger_matches_its_own_case_and_the_tp_one_only_empty_shards():
    known = load_known()
    with_trigger = {sig: f for sig, f in known.items() if f.trigger}
    assert "fsdp2.error.other.RuntimeError.b4090951" in with_trigger
    for sig, f in with_trigger.items():
        assert triggered(f.case, {sig: f}) == sig  # a trigger that misses its own repro counts nothing
    sig = "fsdp2.error.other.RuntimeError.b4090951"
    case = known[sig].case  # Embedding(6, 1) colwise on 2 TP ranks: one holds an empty column shard
    layers = list(case.model.layers)
    layers[0] = dataclasses.replace(layers[0], d_out=2)
    layers[1] = dataclasses.replace(layers[1], d_in=2)
    wide = dataclasses.replace(case, model=dataclasses.replace(case.model, layers=tuple(layers)))
    assert triggered(wide, {sig: known[sig]}) is None  # two columns on two TP ranks: runs


def test_wrapped_models_keep_plain_fqns():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 3)), torch.nn.Linear(3, 1))
    inner = model[0][0]
    model[0] = checkpoint_wrapper(model[0])
    assert "0._checkpoint_wrapped_module.0.weight" in dict(model.named_parameters())
    assert list(named_params(model)) == ["0.0.weight", "0.0.bias", "1.weight", "1.bias"]
    assert submodule(model, "0.0") is inner
    assert submodule(model, "0") is model[0]  # the wrapper answers for what it wraps
    with pytest.raises(AttributeError):
        submodule(model, "0.5")
