"""The standalone repro flattens the kernel modules into one namespace: a
top-level name defined in two of them would silently replace the other."""
import ast
import importlib
import inspect

import pytest

from fuzzshard import targets
from fuzzshard.findings import repro




@pytest.mark.parametrize("target", targets.builtin() + ["parallelize"])
def test_flattened_modules_define_each_top_level_name_once(target):
    if target == "parallelize":  # a plugin's parallelism: fsdp2's module and the adapter
        modules = repro.kernel_modules("fsdp2") + ["fuzzshard.kernel.targets.parallelize"]
    else:
        modules = repro.kernel_modules(target)
    owner: dict[str, str] = {}
    clashes = []
    for name in modules:
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        for node in tree.body:
            defined = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                defined = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets_ = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = [t.id for t in targets_ if isinstance(t, ast.Name) and t.id != "__all__"]
            for d in defined:
                if d in owner and owner[d] != name:
                    clashes.append(f"{d}: {owner[d]} and {name}")
                owner[d] = name
    assert not clashes, clashes
