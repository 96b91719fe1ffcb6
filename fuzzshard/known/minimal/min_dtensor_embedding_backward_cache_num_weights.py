# python min_dtensor_embedding_backward_cache_num_weights.py      (one process, gloo, world size 1)
# torch 2.9.1 and 2.10.0: "FAIL: ... EmbeddingBackward0 returned an invalid gradient at index 0 - got [1, 1] but
# expected shape compatible with [4, 1]"; torch 2.13.0, 2.14.1, 2.15.0: "OK (4, 1)".
# Root cause: DTensor's sharding propagation cache keys an op's OpSchema on its DTensor args (mesh, placements,
# shape, stride, dtype) and on the non-tensor args from RuntimeSchemaInfo.static_argnum on; an op registered with
# no schema_info has none of them in the key (_op_schema.py, _recompute_comparison_key). embedding_dense_backward
# (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq) was registered so (_ops/_embedding_ops.py):
# its num_weights, which decides the output's first dim, is not in the key, so a second embedding backward with
# the same grad/index specs and another vocabulary size gets the first one's output spec (its tensor_meta: the
# DTensor's global shape) while the local result has the right shape. Autograd refuses a grad that its param
# cannot be summed to ([1, 1] for a [4, 1] weight); one it can (a [4, 1] grad for a [1, 1] weight) is silently
# summed down. The cache is process-global (a thread-local lru_cache, and from 2.10 the C++ fast path's), so two
# independent training runs in one process meet it, as two embeddings of one model do.
# Fix: pytorch/pytorch#174727 ("[DTensor] Fix embedding_dense_backward cache key missing num_weights": the strategy
# registered with schema_info=RuntimeSchemaInfo(static_argnum=2)), in 2.13.0's source.
# Workaround (what fuzzshard's workers do between cases, pool/worker.py): empty the sharding cache.
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29731")
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


def weight_grad_shape(vocab: int) -> tuple:
    """One embedding (vocab x 1, replicated) forward and backward on one token: its weight grad's shape."""
    w = distribute_tensor(torch.randn(vocab, 1), mesh, [Replicate()]).requires_grad_()
    idx = distribute_tensor(torch.zeros(1, 1, dtype=torch.long), mesh, [Replicate()])
    torch.nn.functional.embedding(idx, w).sum().backward()
    return tuple(w.grad.shape)


print(torch.__version__)
try:
    weight_grad_shape(1)  # fills the cache: embedding_dense_backward -> a (1, 1) grad
    print("OK", weight_grad_shape(4))  # same grad_output and indices specs, num_weights 4
except RuntimeError as e:
    print("FAIL:", e)
dist.destroy_process_group()
