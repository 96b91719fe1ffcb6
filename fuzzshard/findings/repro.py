"""Standalone repro scripts: the straight-line script of scriptgen/ where
it can write the finding (only what the case uses, and the check its verdict failed), else the case inlined plus
the very kernel code that ran it, flattened into one file that needs only
torch and torchrun.

Kernel modules import only stdlib, torch and each other through single-line
``from .x import name`` statements; flattening drops those lines and
concatenates the modules in dependency order, so the names resolve globally.
"""
from __future__ import annotations

import importlib
import inspect
import re

from .. import targets
from ..case import Case
from ..scriptgen import fallback_reason, straight_script
from ..verdict import Verdict

_RELATIVE_IMPORT = re.compile(r"^from \.+[\w.]* import [^(]*$")


def kernel_modules(target: str) -> list[str]:
    """The modules a target's flattened script holds, each after the modules it
    imports: the target's own modules and the kernel's entry point (run.py),
    and what their relative imports reach, top-level or inside a function, read from their source
    (no hand-kept list to forget a new module in), plus mesh.py for the script's main. Order follows the
    top-level imports only: a function's import runs when it is called, after every module is defined."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in _imports(name):
                visit(dep)
            order.append(name)

    # mesh.py: the script's own main builds the meshes (Meshes), as a worker does
    for root in ["fuzzshard.kernel.mesh", "fuzzshard.kernel.targets.base", *targets.module_of(target), "fuzzshard.kernel.run"]:
        visit(root)
    seen = 0
    while seen < len(order):  # then the kernel modules functions import, until nothing new is reached (not
        for dep in _imports(order[seen], nested=True):  # another target's module: two specs in one namespace)
            if dep.startswith("fuzzshard.kernel.") and not dep.startswith("fuzzshard.kernel.targets."):
                visit(dep)
        seen += 1
    return order


def _base(node, name: str) -> str:
    """The module a relative ``from ... import`` in module ``name`` reads from."""
    import importlib.util

    package = name if hasattr(importlib.import_module(name), "__path__") else name.rpartition(".")[0]
    return importlib.util.resolve_name("." * node.level + (node.module or ""), package)


def _imports(name: str, nested: bool = False) -> list[str]:
    """The fuzzshard modules ``name`` imports relatively: at its top level, or (``nested``) inside its functions."""
    import ast

    tree = ast.parse(inspect.getsource(importlib.import_module(name)))
    nodes = [n for n in ast.walk(tree) if n not in tree.body] if nested else tree.body
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = _base(node, name)
            out += [base] if node.module else [f"{base}.{a.name}" for a in node.names]
    return out


def _nested_import(line: str, name: str, flat: list[str]) -> str | None:
    """A relative import inside a function of ``name``, as the flat script of ``flat`` says it: the names of a
    flattened module are the script's globals already, so it binds only an alias, or a module as the one flat
    namespace; None: not such an import, or one of a module left out (kept: it raises if it is ever reached)."""
    import ast

    m = re.match(r"^(\s+)(from \.+[\w.]* import [^(]*)$", line)
    if not m:
        return None
    indent, stmt = m.groups()
    node = ast.parse(stmt.split("#")[0].strip()).body[0]
    base = _base(node, name)
    binds = []
    for a in node.names:
        if f"{base}.{a.name}" in flat:  # a module: in the flat script, the script itself
            binds.append(f"{a.asname or a.name} = sys.modules[__name__]")
        elif base not in flat:
            return None
        elif a.asname:
            binds.append(f"{a.asname} = {a.name}")
    return indent + ("; ".join(binds) or "pass") + f"  # (flattened: {stmt.strip()})"


def _joined(src: str) -> list[str]:
    """The source's lines, a parenthesized relative import (over one line or
    several) as one line without its parentheses, so that it is dropped too."""
    out: list[str] = []
    open_import = False
    for ln in src.splitlines():
        if open_import:
            out[-1] += " " + ln.strip()
        elif re.match(r"^from \.+[\w.]* import \(", ln):
            out.append(ln)
            open_import = True
        else:
            out.append(ln)
        if open_import and ")" in ln:
            out[-1] = out[-1].replace("(", "").replace(")", "").rstrip(", ")
            open_import = False
    return out


def flatten(modules: list[str]) -> str:
    parts = []
    for name in modules:
        src = _joined(inspect.getsource(importlib.import_module(name)))
        aliased = [ln for ln in src if _RELATIVE_IMPORT.match(ln) and " as " in ln]
        if aliased:  # a dropped line cannot bind the alias in the one flat namespace
            raise ValueError(f"{name}: an aliased relative import cannot be flattened: {aliased[0]}")
        lines = [_nested_import(ln, name, modules) or ln for ln in src
                 if not _RELATIVE_IMPORT.match(ln) and ln != "from __future__ import annotations"]
        parts.append(f"# ---- {name} " + "-" * max(0, 70 - len(name)) + "\n" + "\n".join(lines).strip() + "\n")
    return "\n\n".join(parts)


def script(case: Case, headline: str = "", environment: dict | None = None, flat: bool = False,
           verdict: Verdict | None = None) -> str:
    """The standalone repro of ``case``: the straight-line script (scriptgen/:
    only what the case uses; with the finding's ``verdict``, only the check it
    failed) where it can be written, else, or with ``flat``, the flattened kernel, its header saying why."""
    why = (fallback(case, environment, verdict) or "asked for (--flat)") if flat else ""
    if not flat:
        try:
            text = straight_script(case, headline, environment, verdict)
        except Exception as e:  # a generator fault must never cost a finding its repro: the flat one still runs
            text, why = None, f"the script writer failed: {type(e).__name__}: {e}"[:200]
        if text is not None:
            return text
        why = why or fallback(case, environment, verdict)
    cls = targets.get(case.target)
    cls = getattr(cls, "script_class", cls.__name__)
    env = environment or {}
    body = flatten(kernel_modules(case.target))
    return _TEMPLATE.format(
        headline=headline or "a fuzzshard case",
        why=why.replace("\\", "/").replace('"', "'"),
        world=case.ranks,
        torch=env.get("torch", "?"),
        backend=env.get("backend", "gloo"),
        body=body,
        case_json=case.to_json(indent=1),
        target_cls=cls,
    )


def fallback(case: Case, environment: dict | None = None, verdict: Verdict | None = None) -> str:
    """Why a finding's repro is the flattened kernel ("" where it is the straight-line script)."""
    try:
        return fallback_reason(case, environment, verdict) or ""
    except Exception as e:
        return f"the script writer failed: {type(e).__name__}: {e}"[:200]


def kind_note(case: Case, environment: dict | None = None, verdict: Verdict | None = None) -> str:
    """What a finding's .py is, where the files are listed: nothing for the straight-line script."""
    why = fallback(case, environment, verdict)
    return f"flattened kernel (fallback: {why})" if why else ""


_TEMPLATE = '''#!/usr/bin/env python
"""fuzzshard repro: {headline}

This is the flattened kernel (fallback: {why}), not the straight-line script.

Run:   torchrun --nproc-per-node {world} THIS_FILE.py
Found with torch {torch}, backend {backend}. Needs only torch.
Exit code 0: no divergence now; 1: the divergence reproduces (printed below).
The code below is fuzzshard's own kernel, flattened: it builds the model from
CASE, trains it sharded, then replays an unsharded reference anchored on the
sharded state before every step and compares (see the oracles section).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

{body}

# ---- the case -------------------------------------------------------------
CASE_JSON = r"""
{case_json}
"""
TARGET = {target_cls}


def _plugin_shim() -> None:
    """A --plugin file registers its optimizer through ``fuzzshard.plugin``:
    here that registers into this script's own kernel, fuzzshard or not."""
    import types

    def optimizer(cls, kwargs=None, name=None, elementwise=True):
        USER_OPTIMIZERS[name or cls.__name__] = cls
        return cls

    def model(build, sizes=None, name=None, tokens=False):
        USER_MODELS[name or build.__name__] = build
        return build

    def parallelism(parallelize, options=None, name=None, models=(), dp_dims=None, checkpoints=True):
        if "USER_PARALLELISMS" in globals():  # this script's target is a parallelism
            USER_PARALLELISMS[name or parallelize.__name__] = (parallelize, dp_dims)
        return parallelize

    shim = types.ModuleType("fuzzshard.plugin")
    shim.optimizer, shim.model, shim.parallelism = optimizer, model, parallelism
    package = sys.modules.get("fuzzshard") or types.ModuleType("fuzzshard")
    package.plugin = shim
    sys.modules["fuzzshard"], sys.modules["fuzzshard.plugin"] = package, shim


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--setup", help="a Python file run before the case (a patch of torch, e.g. a planted bug)")
    args = ap.parse_args()
    if args.setup:
        _plugin_shim()
        exec(compile(open(args.setup).read(), args.setup, "exec"), {{"__name__": "__fuzzshard_setup__", "__file__": args.setup}})
    torch.set_num_threads(1)
    case = Case.from_json(CASE_JSON)
    if int(os.environ.get("WORLD_SIZE", "0")) != case.ranks:
        print(f"run me with: torchrun --nproc-per-node {{case.ranks}} {{sys.argv[0]}}", file=sys.stderr)
        return 2
    import shutil
    import tempfile
    from datetime import timedelta

    device = "cpu"
    if case.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{{torch.cuda.current_device()}}"
    dist.init_process_group("nccl" if case.device == "cuda" else "gloo", timeout=timedelta(seconds=120))
    meshes = Meshes(case.ranks, case.device)
    rank = dist.get_rank()
    ckpt = [tempfile.mkdtemp(prefix="fuzzshard-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)  # one directory every rank sees (one machine)
    try:
        verdict = run_case(case, meshes, TARGET, device, reporter=rank == 0, ckpt_dir=ckpt[0])
    finally:  # rank 0 returns last from the loading side's collectives
        if rank == 0:
            shutil.rmtree(ckpt[0], ignore_errors=True)
    if verdict is None or verdict["status"] == "pass":
        if rank == 0:
            print("PASS: the sharded run matches the reference")
        dist.destroy_process_group()
        return 0
    shown = {{k: v for k, v in verdict.items() if k not in ("mismatches",)}}
    print(f"rank {{rank}}: {{verdict['status'].upper()}}:", json.dumps(shown, indent=1, default=str))
    if verdict["status"] == "invalid":
        return 0
    return 1


if __name__ == "__main__":
    code = _main()
    # Skip interpreter finalization: with a DeviceMesh alive, gloo's run-loop
    # thread can abort the process there (a torch teardown race, not the case).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
'''
