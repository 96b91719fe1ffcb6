"""The modules a pp rank builds from the plain model: each stage's, and its own part.

Each stage's module, which its ``PipelineStage`` runs (``_StageModule``: its
layers under their plain names, the decoder's ends by ``stage_ends``), and
the rank's own part (``_Local``), which its optimizer and the observations
see under the plain model's FQNs (``PPTarget.shard`` builds both).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def stage_ends(model: nn.Module, s: int, last: int) -> dict:
    """The decoder's modules around its blocks, as torchtitan splits it: the token embedding on the first
    stage, the final norm and the output head on the last; a topology's tied head on the last."""
    if not hasattr(model, "tok_embeddings"):
        return {"head": model.head} if s == last and hasattr(model, "head") else {}
    return {**({"tok_embeddings": model.tok_embeddings} if s == 0 else {}),
            **({"norm": model.norm, "output": model.output} if s == last else {})}


class _StageModule(nn.Module):
    """One stage: its layers under their plain names (``layers.<i>``), on
    the last stage the output scale (a buffer); a decoder's stage has its
    ``stage_ends`` too."""

    def __init__(self, layers: dict, scale: torch.Tensor | None, ends: dict):
        super().__init__()
        for name, module in ends.items():
            setattr(self, name, module)
        self.layers = nn.ModuleDict(layers)
        if scale is not None:
            self.register_buffer("scale", scale)

    def forward(self, x):
        if hasattr(self, "tok_embeddings"):
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if hasattr(self, "output"):
            x = self.output(self.norm(x))
        if hasattr(self, "head"):
            x = self.head(x)
        if hasattr(self, "scale"):
            x = x * self.scale
        return x


class _Local(nn.Module):
    """This rank's part of the model: every layer of its stages under its
    plain name (and ``unused``, on the last stage's rank); what the optimizer
    and the observations see. ``tie``: on a rank holding the tied head but not
    the first stage, the tied weight (as the head's stage module holds it)
    under its owner's FQN, first: the name the case's groups and the
    observations give it."""

    def __init__(self, layers: dict, unused: nn.Module | None, ends: dict, tie: tuple | None = None):
        super().__init__()
        if tie and tie[0] != "layers.0":
            self.add_module(tie[0], _Holder(tie[1]))
        for name, module in ends.items():
            if name != "head":
                setattr(self, name, module)
        self.layers = nn.ModuleDict(({"0": _Holder(tie[1])} if tie and tie[0] == "layers.0" else {}) | layers)
        if "head" in ends:  # after the layers: the tied weight's name is layers.0's, as in the whole model
            self.head = ends["head"]
        if unused is not None:
            self.unused = unused


class _Holder(nn.Module):
    """A module holding a tied weight under the name ``weight`` (never run)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
