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


@pytest.mark.parametrize("target", targets.builtin())
def test_a_functions_relative_import_in_the_flat_script_binds_or_is_of_a_module_left_out(target):
    """A relative import inside a function cannot run in the flat script (no package): one of a flattened
    module's names becomes ``pass`` (or an alias, or the flat namespace for a module); the modules functions
    import are flattened too, so a flattened repro reaches them (moe.py's ``from .oracles import ...`` once
    failed pp.parity.grad.uneven's flat script with an ImportError under torchrun)."""
    modules = repro.kernel_modules(target)
    assert "fuzzshard.kernel.sync" in repro.kernel_modules("fsdp2") and "fuzzshard.kernel.oracles" in modules
    text = repro.flatten(modules)
    compile(text, f"<flat {target}>", "exec")
    left = [ln.strip() for ln in text.splitlines() if ln.startswith((" ", "\t")) and ln.strip().startswith("from .")]
    kernel_left = [ln for ln in left if ln.startswith(("from .model ", "from .oracles ", "from .moe ", "from ..sync "))]
    assert not kernel_left, kernel_left
    assert "pass  # (flattened: from .oracles import compare_replicas)" in text or "compare_replicas" not in text
