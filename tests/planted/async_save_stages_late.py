"""Planted bug (pytorch/pytorch#144657, as torch staged before #145408): the
CPU "copy" async_save stages is no copy. BlockingAsyncStager (the file-system
writer staging for itself) offloads the state dict to CPU, a no-op for CPU
tensors, and DefaultStager's StateDictStager hands a CPU tensor back as it
is; so the upload thread writes the live tensors, as training has changed
them since the call returned (silent, CPU only). The upload starts 0.2 s late
(a slow disk), so a step after the call always lands before the write."""
import time

from torch.distributed._state_dict_utils import _offload_state_dict_to_cpu
from torch.distributed.checkpoint import _async_thread_executor as executor
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import BlockingAsyncStager

_stage, _offload_tensor = BlockingAsyncStager.stage, StateDictStager._offload_tensor
_save_wrapper = executor.save_wrapper


def stage(self, state_dict):
    if self.cache_staged_state_dict:
        return _stage(self, state_dict)
    return _offload_state_dict_to_cpu(state_dict, type_check=self.type_check)  # torch's line before #145408


def offload_tensor(self, x, memo, non_blocking=False):
    if x.device.type == "cpu":  # "already on CPU": no copy
        return x
    return _offload_tensor(self, x, memo, non_blocking=non_blocking)


def save_wrapper(*args, **kwargs):
    time.sleep(0.2)
    return _save_wrapper(*args, **kwargs)


BlockingAsyncStager.stage = stage
StateDictStager._offload_tensor = offload_tensor
executor.save_wrapper = save_wrapper
