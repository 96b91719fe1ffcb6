"""A plugin model for the ep target's hand-written cases: one MoE layer (kernel/moe.py) on [B, L, d_in] features."""
import hypothesis.strategies as st
import torch.nn as nn
from fuzzshard import plugin
from fuzzshard.kernel.moe import MoE


class MoENet(nn.Module):
    def __init__(self, d_in, **cfg):
        super().__init__()
        self.moe = MoE(d_in, cfg)

    def forward(self, x):
        return x if x.is_meta else self.moe(x)


def moe_net(**sizes):
    return MoENet(**sizes)


plugin.model(moe_net, st.fixed_dictionaries({"d_in": st.integers(1, 4), "experts": st.sampled_from([2, 4]),
                                             "hidden": st.integers(1, 3)}), name="moe_net")
