"""Planted bug (torchao float8 with FSDP2's float8 all-gather): the weight's scale sent with the all-gather is the
one of the step before (as a scale precomputed once and not refreshed after the optimizer step would be): from
the second step on, each float8 weight is cast with last step's amax while the unsharded float8 model takes this
step's, so its e4m3 values sit on another grid (and a weight that grew past last step's amax saturates)."""
import weakref

import torchao.float8.fsdp_utils as fsdp_utils
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

_cls = fsdp_utils.WeightWithDynamicFloat8CastTensor
_orig = _cls.fsdp_pre_all_gather
_seen = {}  # id(shard) -> (its weakref, the weight's version, the scale sent at it, the scale due at it)


def fsdp_pre_all_gather(self, mesh):
    (data,), (scale,) = _orig(self, mesh)  # (its amax all-reduce still runs: the collectives stay matched)
    key, version = id(self), self._tensor._version
    last = _seen.get(key)
    if last is None or last[0]() is not self:
        sent = scale  # the first step: no scale before it
    elif last[1] == version:
        sent = last[2]  # the same step's backward all-gather: what its forward sent
    else:
        sent = last[3]  # a step later (the optimizer stepped the weight in place): the previous step's scale
    _seen[key] = (weakref.ref(self), version, sent, scale)
    if sent is scale:
        return (data,), (scale,)
    f8 = hp_tensor_and_scale_to_float8(self._tensor, sent, self._dtype, self._linear_mm_config, GemmInputRole.WEIGHT)
    return (f8._data,), (f8._scale,)


_cls.fsdp_pre_all_gather = fsdp_pre_all_gather
