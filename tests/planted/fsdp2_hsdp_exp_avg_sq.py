"""Planted bug: on FSDP2's HSDP 2x2 mesh (replicate x shard), from the second
step on, the step leaves exp_avg_sq twice what it should be (as a replica
sync that adds the other replica's copy instead of keeping its own would).
Needs world size 4 with its 2-D mesh, an optimizer with exp_avg_sq, and two
steps: a corner of three dimensions at once (bench --hunt)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _wrap import wrap_steps  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402


def _hsdp(p) -> bool:
    return (isinstance(p, DTensor) and tuple(p.device_mesh.shape) == (2, 2)
            and isinstance(p.placements[0], Replicate))


def make_step(orig):
    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state.get(p, {})
                    sq = st.get("exp_avg_sq")
                    if _hsdp(p) and isinstance(sq, torch.Tensor) and float(st.get("step", 0)) >= 2:
                        (sq.to_local() if isinstance(sq, DTensor) else sq).mul_(2.0)
        return out

    return step


wrap_steps(make_step)
