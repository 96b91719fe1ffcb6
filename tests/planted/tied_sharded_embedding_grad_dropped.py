"""Planted bug: nn.Embedding's forward looks its rows up in a detached weight where the weight is sharded
(a DTensor: TP's vocabulary-parallel embedding, the dtensor target's placements) or the embedding is in a
fully_shard unit of its own (fsdp2's tie_unit: fully_shard([embedding, head])), so that use gives the
weight no grad. The unsharded reference keeps both uses. A weight tied to an output head gets the head's
part of its grad alone: the parity oracle sees the tied weight's grad short by the embedding's part (the
sum of both uses is what it should be). Nothing raises."""
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_orig = nn.Embedding.forward


def forward(self, input):
    if isinstance(self.weight, DTensor) or isinstance(self, FSDPModule):
        return F.embedding(input, self.weight.detach(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)
    return _orig(self, input)


nn.Embedding.forward = forward
