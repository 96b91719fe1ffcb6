"""Planted bug (torchao float8): the float8 all-gather's weight amax is taken over this rank's shard only (the
MAX all-reduce over the shard group skipped), so each rank casts its shard with its own scale and every rank
reads the gathered float8 weight with its own one."""
import torchao.float8.float8_utils as utils

_orig = utils.tensor_to_amax


def tensor_to_amax(x, reduce_amax=False, device_mesh=None, *args, **kwargs):
    return _orig(x, False, device_mesh, *args, **kwargs)


utils.tensor_to_amax = tensor_to_amax
