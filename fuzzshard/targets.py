"""The registry of targets: name -> the class that shards a model for it.

Built-in targets are the modules of kernel/targets/, imported lazily
(importing FSDP costs time). Users add their own from a ``--plugin`` or
``--worker-setup`` file::

    from fuzzshard.targets import register_target
    register_target("mine", MyTarget)   # same interface as kernel/targets/dtensor.py

A target is one module (or one package, as pp/): its adapter class
(kernel/targets/base.py's Target) and its ``spec`` (base.Spec: what it can do), which the strategies, the Case
checks, ``show`` and the findings read; nothing else names a target.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

# kernel/targets/NAME.py (or the package kernel/targets/NAME/) is the built-in target NAME (its class says
# ``name = "NAME"``): adding a target is adding its module. Not targets: the interface, and the adapter of a
# plugin's parallelism.
_PACKAGE = "fuzzshard.kernel.targets"
_NOT_TARGETS = {"base", "parallelize"}
_BUILTIN = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "kernel" / "targets")])
                  if m.name not in _NOT_TARGETS)
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


def builtin() -> list[str]:
    """The targets fuzzshard ships (kernel/targets/), without those a plugin registered."""
    return list(_BUILTIN)


def get(name: str) -> type:
    if name in _USER:
        return _USER[name]
    if name not in _BUILTIN:
        raise KeyError(f"unknown target {name!r} (known: {', '.join(names())})")
    module = importlib.import_module(f"{_PACKAGE}.{name}")  # imported when first asked for: FSDP costs time
    # defined in the module, or (a target that is a package, as pp/) in one of its own modules, named in its __init__
    found = [c for c in vars(module).values()
             if isinstance(c, type) and (c.__module__ + ".").startswith(module.__name__ + ".")
             and getattr(c, "name", None) == name]
    if len(found) != 1:
        raise TypeError(f"{module.__name__} must define one target class with name = {name!r}, found {len(found)}")
    return found[0]


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


def case_problem(case) -> str | None:
    """What the kernel's rules refuse in ``case`` (Case.check asks, after its own): those of every target and its
    target's own (kernel/targets/base.py ``case_problem``), reached through the registry as a target's module is,
    so the case format imports no kernel module; None where they take it."""
    base = importlib.import_module(f"{_PACKAGE}.base")
    return base.case_problem(case, get(case.target) if case.target in names() else None)
