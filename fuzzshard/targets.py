"""The registry of targets: name -> the class that shards a model for it.

Built-in targets are imported lazily (importing FSDP costs time). Users add
their own from a ``--worker-setup`` file::

    from fuzzshard.targets import register_target
    register_target("mine", MyTarget)   # same interface as kernel/targets/dtensor.py

A target is one module: its adapter class (kernel/targets/base.py's Target)
and its ``spec`` (base.Spec: what it can do), which the strategies, the Case
checks, ``show`` and the findings read; nothing else names a target.
"""
from __future__ import annotations

import importlib

_BUILTIN = {
    "dtensor": "fuzzshard.kernel.targets.dtensor:DTensorTarget",
    "fsdp2": "fuzzshard.kernel.targets.fsdp2:FSDP2Target",
    "fsdp1": "fuzzshard.kernel.targets.fsdp1:FSDP1Target",
    "zero": "fuzzshard.kernel.targets.zero:ZeroTarget",
    "sharded_optim": "fuzzshard.kernel.targets.sharded_optim:ShardedOptimTarget",
}
_USER: dict[str, type] = {}


def register_target(name: str, cls: type, spec=None) -> None:
    """``cls``: a subclass of ``fuzzshard.kernel.targets.base.Target``; ``spec``
    (a ``base.Spec``): what it can do (its options draw, checkpoint kinds,
    rules, facts), unless the class says it itself as ``cls.spec``."""
    if spec is not None:
        cls.spec = spec
    _USER[name] = cls


def names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_USER))


def get(name: str) -> type:
    if name in _USER:
        return _USER[name]
    if name not in _BUILTIN:
        raise KeyError(f"unknown target {name!r} (known: {', '.join(names())})")
    module, _, attr = _BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def module_of(name: str) -> list[str]:
    """Import paths of the modules a target's class comes from (the repro
    script inlines them, bases first; base.py is inlined anyway)."""
    cls = get(name)
    out = []
    for c in reversed(cls.__mro__):
        m = c.__module__
        if m.startswith("fuzzshard.kernel.targets.") and m != "fuzzshard.kernel.targets.base" and m not in out:
            out.append(m)
    return out
