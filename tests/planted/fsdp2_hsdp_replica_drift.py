"""Planted bug: on FSDP2's HSDP 2x2 mesh (replicate x shard), the step leaves
exp_avg_sq twice what it should be on the second replica only (ranks 2 and 3),
as a replica sync that adds the other replica's copy on one side would. The
reporting rank's replica is right: only the replica oracle sees it (from the
first step on). Needs world size 4 with its 2-D mesh and an optimizer with
exp_avg_sq."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402


def _second_replica(p) -> bool:
    return (isinstance(p, DTensor) and tuple(p.device_mesh.shape) == (2, 2)
            and isinstance(p.placements[0], Replicate) and p.device_mesh.get_local_rank(0) == 1)


def make_step(orig):
    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    sq = self.state.get(p, {}).get("exp_avg_sq")
                    if _second_replica(p) and isinstance(sq, torch.Tensor):
                        (sq.to_local() if isinstance(sq, DTensor) else sq).mul_(2.0)
        return out

    return step


wrap_steps(make_step)
