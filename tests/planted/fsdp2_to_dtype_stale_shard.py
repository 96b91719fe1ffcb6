"""Planted bug: model.to(dtype) after fully_shard forgets to re-register the
sharded params (FSDPParam.reset_sharded_param does nothing): FSDP2 keeps
all-gathering the shard storage of the dtype the model was built in."""
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

FSDPParam.reset_sharded_param = lambda self: None
