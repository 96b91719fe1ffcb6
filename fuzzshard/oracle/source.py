"""Where in torch's source a finding points: the torch frames of a
traceback or a faulthandler dump, the innermost one that makes an error
rather than passes it along, and a link to a torch file:line at this torch's
tag. Root-cause addresses and upstream reports both read them."""
from __future__ import annotations

import importlib
import inspect
import re

from ..verdict import Verdict

# frames that pass an error along rather than make it: the address is the innermost frame that is not one
_PASSING = ("_ops.py", "nn/modules/module.py", "autograd/graph.py", "autograd/__init__.py", "_tensor.py",
            "utils/_stats.py", "utils/_contextlib.py", "_compile.py", "_dynamo/", "__init__.py",
            "distributed/utils.py", "distributed/tensor/_dispatch.py", "optim/optimizer.py")
# a traceback's frame line ("line N, in f") and faulthandler's ("line N in f")
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def torch_frames(text: str, innermost_first: bool = False) -> list[tuple[str, int, str]]:
    """The torch frames of a traceback (or of a faulthandler dump: ``innermost_first``),
    innermost first, as (path under torch/, line, function)."""
    frames = [(p, int(line), fn) for p, line, fn in _FRAME.findall(text or "") if "/torch/" in p]
    frames = frames if innermost_first else frames[::-1]
    return [(p.split("site-packages/torch/", 1)[1] if "site-packages/torch/" in p else p.rsplit("/torch/", 1)[1],
             line, fn) for p, line, fn in frames]


def telling_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost of ``frames`` that makes an error rather than passes one along."""
    return next((f for f in frames if not any(f[0] == g or f[0].startswith(g) or f[0].endswith("/" + g)
                                              for g in _PASSING)), None)


def innermost(traceback_text: str) -> str:
    """The innermost torch frame that makes an error, as "torch/PATH:function"."""
    frames = torch_frames(traceback_text)
    made = telling_frame(frames)
    if made:
        return f"torch/{made[0]}:{made[2]}"
    return "torch (no telling frame)" if frames else "fuzzshard or the test (no torch frame)"


def frame_source(verdict: Verdict, innermost_first: bool = False) -> str:
    """"`torch/x.py:N` (function) <url>, the innermost torch frame" of the verdict's error traceback
    or crash log (a faulthandler dump: ``innermost_first``), or ""."""
    err = verdict.error_record
    made = telling_frame(torch_frames((err.traceback or "") + "\n" + err.extra.get("log", ""),
                                      innermost_first=innermost_first))
    if not made:
        return ""
    rel, line, fn = made
    return f"`torch/{rel}:{line}` ({fn}){url(f'torch/{rel}', line)}, the innermost torch frame"


def link(api: str) -> str:
    """"torch/optim/adam.py:_single_tensor_adam" -> "`torch/optim/adam.py:123` (_single_tensor_adam) <url>"
    (the first path:function of a root cause's api, which may name more after it)."""
    m = re.match(r"(torch/[\w/]+\.py):([\w.]+)", api)
    line = line_of(m.group(1), m.group(2)) if m else None
    if not line:
        return f"`{api}`"
    rest = api[m.end():].strip()
    return f"`{m.group(1)}:{line}` ({m.group(2)}){url(m.group(1), line)}" + (f" (recorded: `{api}`)" if rest else "")


def line_of(path: str, name: str) -> int | None:
    """The line of function or Class.method ``name`` in torch's ``path`` (a bare method name is looked
    up on the module's classes), as installed here."""
    try:
        module = importlib.import_module(path[:-3].replace("/", "."))
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None and "." not in name:
                obj = next((getattr(c, name) for c in vars(module).values()
                            if inspect.isclass(c) and c.__module__ == module.__name__ and name in vars(c)), None)
            if obj is None:
                return None
        return inspect.getsourcelines(inspect.unwrap(obj))[1]
    except Exception:  # a private name moved in this torch: the path alone still says where
        return None


def url(path: str, line: int | None) -> str:
    """" — https://github.com/pytorch/pytorch/blob/vX.Y.Z/path#LN", or "" where this torch has no tag."""
    import torch

    version = torch.__version__.split("+")[0]
    if not line or not re.fullmatch(r"\d+\.\d+\.\d+", version):
        return ""  # a nightly or local build has no tag to point at
    return f" — https://github.com/pytorch/pytorch/blob/v{version}/{path}#L{line}"
