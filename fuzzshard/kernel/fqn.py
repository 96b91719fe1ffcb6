"""A param's or module's name as the plain model has it, whatever wrappers a target put in between (the
model's builder and the MoE layers it holds both name things so: model.py, moe.py)."""
from __future__ import annotations

# modules torch puts between a module and its children (FSDP1's unit, the
# activation-checkpoint wrapper); FQNs leave them out, as DSD's state dicts do
WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def plain_fqn(name: str) -> str:
    """A name in a wrapped model as the plain model has it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)
