"""Hide torchao as if it were not installed (tests/test_ao_missing.py, and by hand: PYTHONPATH=tests/data/no_torchao:. ...):
every meta-path finder answers None for torchao and its submodules, so find_spec says missing and import raises."""
import sys


class _Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            return None
        f = getattr(self.inner, "find_spec", None)
        return f(name, path, target) if f else None

    def __getattr__(self, key):
        return getattr(self.inner, key)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
