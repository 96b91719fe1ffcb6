"""A straight-line standalone repro: only what one case uses, written out.

``straight_script(case)`` writes a short torch-only script: the model as
explicit nn modules, the target's own calls (``distribute_tensor`` with the
case's placements, or ``fully_shard`` on its units), the optimizer with its
exact kwargs and param groups, the schedule, and a plain model beside it. As
the kernel does (run.py, reference.py), the sharded run goes first, then the
plain model replays each step from the sharded run's params, grads and
optimizer state before it, so only that step's rounding can differ (and an
error anywhere in the sharded run is what the script shows); the bounds are the kernel's
(kernel/oracles.py), written out as numbers with a line saying where they come
from. Cases it cannot write return None: repro.script falls back to the
flattened kernel.
"""
from __future__ import annotations

import math
import textwrap

import torch

from .case import Case, Layer
from .kernel.model import out_dim, param_shapes
from .kernel.optim import _TUPLE_KWARGS  # kwargs torch documents as tuples (a Case holds lists)
from .kernel.oracles import STEP_ULPS, UNIT_ROUNDOFF
from .kernel.reference import reduction_parts  # the kernel's loss/grad bound, as factors

_ACTS = {"relu": "nn.ReLU()", "gelu": "nn.GELU()", "tanh": "nn.Tanh()", "silu": "nn.SiLU()"}
_FSDP2_OPTIONS = {"wrap", "reshard_after_forward"}


def straight_script(case: Case, headline: str = "", environment: dict | None = None) -> str | None:
    """A short torch-only script (``torchrun --nproc-per-node W file.py``) that
    trains the case sharded and plain side by side and exits 1 where they
    differ beyond rounding, 0 where they match; None where the case uses
    something this generator does not write (the caller falls back)."""
    if not _supported(case):
        return None
    env = environment or {}
    u = f"2.0 ** -{round(-math.log2(UNIT_ROUNDOFF[case.dtype]))}"
    parts = [_header(case, headline, env), _imports(case),
             f"DTYPE, SEED = torch.{case.dtype}, {case.seed}\nU = {u}  # unit roundoff of {case.dtype}\n"
             + _tolerances(case), _model(case), _shard(case), _optimizer(case), _batch(case), _main(case),
             "# ---- comparing with rounding bounds: the same in every script " + "-" * 36, _HELPERS,
             _PARTIAL if case.target == "dtensor" else _NO_PARTIAL, _END]
    return "\n\n".join(p.strip("\n") for p in parts if p) + "\n"


def _supported(case: Case) -> bool:
    opts = case.target_options
    if case.checkpoint or case.device != "cpu" or case.model.factory or case.dtype not in ("float32", "float64"):
        return False
    if not hasattr(torch.optim, case.optim.name) or not _literal_ok(case.optim.kwargs) \
            or not all(_literal_ok(g.overrides) for g in case.groups):
        return False
    if any(layer.kind == "act" and layer.act not in _ACTS for layer in _walk(case.model.layers)):
        return False
    if case.target == "dtensor":
        return set(opts) <= {"placements"}
    if case.target == "fsdp2":  # plain fully_shard: no TP, mixed precision, offload, compile, accumulation
        return set(opts) <= _FSDP2_OPTIONS and case.batch % case.world_size == 0
    return False


def _walk(layers):
    for layer in layers:
        yield layer
        yield from _walk(layer.children)


def _literal_ok(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _literal_ok(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_literal_ok(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _lit(value, key: str = "") -> str:
    """A Python literal of a JSON value; the kwargs torch documents as tuples as tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, (list, tuple)):
        items = [_lit(v) for v in value]
        if key in _TUPLE_KWARGS:
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        return f"[{', '.join(items)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_lit(v, k)}" for k, v in value.items()) + "}"
    return repr(value)


def _kwargs(kwargs: dict, tensor_lr: str) -> list[str]:
    out = []
    for k, v in kwargs.items():
        text = _lit(v, k)
        if k == "lr" and tensor_lr:  # a tensor lr, on the CPU, as users make it
            text = f"torch.tensor({text})" if tensor_lr == "0d" else f"torch.tensor([{text}])"
        out.append(f"{k}={text}")
    return out


# ---- the parts of the script ----------------------------------------------

def _header(case: Case, headline: str, env: dict) -> str:
    what = "DTensor params (distribute_tensor)" if case.target == "dtensor" else "FSDP2 (fully_shard)"
    headline = (headline or "a fuzzshard case").replace("\\", "/").replace('"', "'")  # stays in the docstring
    about = textwrap.fill(
        f"Needs only torch; found with torch {env.get('torch', '?')}, {env.get('backend', 'gloo')}. Written by fuzzshard "
        f"from a shrunk case: trains a model with {what} and a plain copy side by side. Before each step the plain "
        "copy takes the sharded run's params, grads and optimizer state, so only that step's rounding may differ. "
        "Exit 0: they match; 1: they differ beyond it (what and where, printed).", 100)
    return f'''#!/usr/bin/env python
"""{headline}

Run: torchrun --nproc-per-node {case.world_size} THIS_FILE.py [--setup PATCH.py]
{about}
"""'''


def _imports(case: Case) -> str:
    if case.target == "dtensor":
        own = "from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor"
    else:
        own = "from torch.distributed.fsdp import fully_shard\nfrom torch.distributed.tensor import DTensor"
    return f"""import argparse, datetime, math, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
{own}"""


def _tolerances(case: Case) -> str:
    b, s, d, k, depth = reduction_parts(case)
    name = case.optim.name
    if name == "Adafactor":  # it reduces over a param (row and column means): the step's error grows with it
        numel = max([math.prod(sh) for sh in param_shapes(case.model).values()] or [1])
        step = f"({STEP_ULPS} * 4 * {numel}, U)  # Adafactor sums over a param (its largest: {numel} elements)"
    elif name == "Muon":  # its Newton-Schulz iteration runs in bfloat16, one reduction per iteration
        step = f"({STEP_ULPS} * {case.optim.kwargs.get('ns_steps', 5)}, 2.0 ** -8)  # Muon: ns_steps iterations in bfloat16"
    else:
        step = f"({STEP_ULPS}, U)"
    return (f"# the optimizer steps from the same params, grads and state on both sides: elementwise rounding only\n"
            f"STEP_TOL = {step}\n"
            f"# loss and grads sum the same terms in another order: at most n = batch x seq x widest dim x kernel\n"
            f"# x (layers with params + 2) terms, each order within n ulps of sum|terms| (Higham): 2n ulps\n"
            f"SUM_TOL = (2 * {b} * {s} * {d} * {k} * {depth}, U)")


def _layer(layer: Layer) -> str:
    k = layer.kind
    nobias = "" if layer.bias else ", bias=False"
    inner = ", ".join(_layer(c) for c in layer.children)
    if k == "linear":
        return f"nn.Linear({layer.d_in}, {layer.d_out}{nobias})"
    if k == "embedding":
        return f"nn.Embedding({layer.d_in}, {layer.d_out})"
    if k == "layernorm":
        return f"nn.LayerNorm({layer.d_in}{nobias})"
    if k == "conv1d":
        return f"Conv({layer.d_in}, {layer.d_out}, {layer.kernel}, padding={layer.kernel // 2}{nobias})"
    if k == "act":
        return _ACTS[layer.act]
    return {"seq": "nn.Sequential", "residual": "Residual", "twice": "Twice"}[k] + f"({inner})"


_CLASSES = {
    "conv1d": '''class Conv(nn.Module):  # Conv1d over the sequence axis of a [batch, seq, features] activation
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.conv = nn.Conv1d(*args, **kwargs)
    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)''',
    "residual": '''class Residual(nn.Module):  # x + f(x)
    def __init__(self, *layers):
        super().__init__()
        self.inner = nn.Sequential(*layers)
    def forward(self, x):
        return x + self.inner(x)''',
    "twice": '''class Twice(Residual):  # f(f(x)): one module called twice, its params get two grad contributions
    def forward(self, x):
        return self.inner(self.inner(x))''',
}


def _model(case: Case) -> str:
    spec = case.model
    kinds = {layer.kind for layer in _walk(spec.layers)}
    if "twice" in kinds:
        kinds.add("residual")  # Twice shares Residual's constructor
    classes = [_CLASSES[k] for k in ("conv1d", "residual", "twice") if k in kinds]
    body = ["class Net(nn.Module):", "    def __init__(self):", "        super().__init__()",
            "        self.layers = nn.Sequential(" + "".join(f"\n            {_layer(x)}," for x in spec.layers)
            + ("\n        )" if spec.layers else ")")]
    out = "self.layers(x)"
    if spec.tie_head:
        emb = spec.layers[0]
        body += [f"        self.head = nn.Linear({emb.d_out}, {emb.d_in}, bias=False)  # tied to the embedding:",
                 "        self.head.weight = self.layers[0].weight  # one Parameter in two modules"]
        out = f"self.head({out})"
    if spec.unused:
        body.append("        self.unused = nn.Linear(2, 3)  # never called: its params get no grad")
    if spec.buffer:
        body.append(f"        self.register_buffer(\"scale\", torch.rand({out_dim(spec)}) + 0.5)")
        out = f"{out} * self.scale"
    body += ["    def forward(self, x):", f"        return {out}", "",
             "def build():  # the same seed: the same initial params in the sharded and the plain model",
             "    torch.manual_seed(SEED)", "    return Net().to(DTYPE)"]
    return "\n\n".join(classes + ["\n".join(body)])


def _placement(text: str) -> str:
    return "Replicate()" if text == "R" else f"Shard({text[1:]})"


def _shard(case: Case) -> str:
    if case.target == "fsdp2":
        opts = case.target_options
        raf = opts.get("reshard_after_forward", True)
        units = sorted(opts.get("wrap", []), key=lambda n: (-n.count("."), n))  # children before parents
        lines = ["def shard(model, mesh):  # fully_shard on each unit, children first, then the root"]
        lines += [f"    fully_shard(model.get_submodule({u!r}), mesh=mesh, reshard_after_forward={raf!r})" for u in units]
        lines += [f"    fully_shard(model, mesh=mesh, reshard_after_forward={raf!r})", "    return model"]
        return "\n".join(lines)
    given = case.target_options.get("placements", {})
    rep = ["R"] * len(case.mesh_shape)
    rows = [f"    {n!r}: [{', '.join(_placement(p) for p in given.get(n, rep))}],"
            for n in param_shapes(case.model)]
    lines = ["PLACEMENTS = {  # each param's layout over the mesh dims", *rows, "}", "",
             "def shard(model, mesh):  # every param a DTensor laid out as PLACEMENTS says",
             "    for name, p in list(model.named_parameters()):",
             "        owner, _, attr = name.rpartition(\".\")",
             "        dt = distribute_tensor(p.detach(), mesh, PLACEMENTS[name])",
             "        setattr(model.get_submodule(owner), attr, nn.Parameter(dt))"]
    if case.model.tie_head:
        lines.append("    model.head.weight = model.layers[0].weight  # still tied")
    if case.model.buffer:
        lines.append(f"    model.scale = distribute_tensor(model.scale, mesh, [{', '.join(['Replicate()'] * len(rep))}])")
    lines.append("    return model")
    return "\n".join(lines)


def _optimizer(case: Case) -> str:
    o = case.optim
    names = [list(g.params) for g in case.groups]
    pick = "(n, p[n])" if o.named else "p[n]"
    kw = _kwargs(o.kwargs, o.tensor_lr)
    added = o.added_groups
    single = len(case.groups) == 1 and not case.groups[0].overrides and not added
    lines = ["def make_optimizer(model):", "    p = dict(model.named_parameters())"]
    if single:
        lines.append(f"    return torch.optim.{o.name}([{pick} for n in {names[0]!r}], {', '.join(kw)})")
        return "\n".join(lines)
    lines[0] = "def param_groups(model):  # in the order the optimizer gets them"
    lines.append("    return [")
    for g, ns in zip(case.groups, names):
        extra = "".join(f", {k!r}: {v.split('=', 1)[1]}" for k, v in zip(g.overrides, _kwargs(g.overrides, o.tensor_lr)))
        lines.append(f"        {{\"params\": [{pick} for n in {ns!r}]{extra}}},")
    lines.append("    ]")
    n = len(case.groups) - added
    if not added or o.added_at:  # (groups added mid-run go in from the training loop)
        return "\n".join(lines + ["", "def make_optimizer(model):",
                                   f"    return torch.optim.{o.name}(param_groups(model){f'[:{n}]' * bool(added)}, "
                                   f"{', '.join(kw)})"])
    lines += ["", "def make_optimizer(model):", f"    opt = torch.optim.{o.name}(param_groups(model)[:{n}], {', '.join(kw)})",
              f"    for g in param_groups(model)[{n}:]:  # added after the constructor", "        opt.add_param_group(g)",
              "    return opt"]
    return "\n".join(lines)


def _batch(case: Case) -> str:
    m = case.model
    x = (f"torch.randint(0, {m.d_in}, ({case.batch}, {case.seq}), generator=g)" if m.input == "tokens"
         else f"torch.randn({case.batch}, {case.seq}, {m.d_in}, generator=g).to(DTYPE)")
    return f'''def batch(k):  # step k's inputs and targets (every rank draws the same)
    g = torch.Generator().manual_seed(SEED * 1000 + k + 1)
    x = {x}
    return x, torch.randn({case.batch}, {case.seq}, {out_dim(m)}, generator=g).to(DTYPE)

def loss_fn(out, y):
    return ((out - y) ** 2).mean()'''


_HELPERS = '''def full(t):  # a plain copy of a tensor, a DTensor (its shards gathered) or a Python number
    return None if t is None else (t.full_tensor() if isinstance(t, DTensor) else torch.as_tensor(t)).detach().clone()

def snapshot(model, opt):  # full params, optimizer state by (param, state name), param groups' hyperparameters
    name = {p: n for n, p in model.named_parameters()}
    return ({n: full(p) for n, p in model.named_parameters()},
            {(name[p], k): full(v) for g in opt.param_groups for p in g["params"] for k, v in opt.state.get(p, {}).items()},
            [{k: v.tolist() if torch.is_tensor(v) else v for k, v in g.items() if k not in ("params", "param_names")}
             for g in opt.param_groups])

def load(model, opt, params, grads, state):  # the plain model and optimizer take the sharded run's values
    p = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in params.items():
            p[n].copy_(t)
            p[n].grad = None if grads.get(n) is None else grads[n].clone()
    opt.state.clear()
    for (n, k), v in state.items():
        opt.state[p[n]][k] = v.clone()

def check(what, got, want, tol, sens=0.0, extra=0.0):
    """None if |got - want| <= k*u*(max|want| + |want|) + k*sens + extra everywhere (tol = (k, u)), else what differs."""
    if got is None or want is None or got.shape != want.shape:
        shape = lambda t: "none" if t is None else f"shape {tuple(t.shape)}"
        return None if got is None and want is None else f"{what}: sharded has {shape(got)}, plain has {shape(want)}"
    (k, u), g, w, fin = tol, got.double(), want.double(), got.isfinite() & want.isfinite()
    if not (fin | (g == w) | (g.isnan() & w.isnan())).all():
        return f"{what}: NaN or inf in one run only"
    if w.numel() == 0:
        return None
    g, w = g.where(fin, 0), w.where(fin, 0)
    err, bound = (g - w).abs(), k * u * (w.abs().max() + w.abs()) + k * sens + extra
    if not (bad := err > bound).any():
        return None
    i = int((err - bound).where(bad, 0).argmax())  # the element furthest out of bounds
    at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), w.shape))
    return (f"{what}: max abs err {err.max():.3g} ({int(bad.sum())}/{w.numel()} elements off); at {at}: "
            f"sharded {g.flatten()[i]:.8g}, plain {w.flatten()[i]:.8g}, allowed {bound.flatten()[i]:.3g}")

def check_state(when, got, want, rel={}):  # every optimizer state tensor, on either side
    return [check(f"{when} state {n} {k}", got.get((n, k)), want.get((n, k)), STEP_TOL, extra=slack(rel, n, want.get((n, k))))
            for n, k in sorted(set(got) | set(want))]

def sensitivity(model, x, y):
    """How far one-ulp nudges of every param and float input move the loss and each grad (the largest of 4
    random draws): rounding acts like such nudges, and where a result cancels to ~0 it is all there is."""
    ps, gen = dict(model.named_parameters()), torch.Generator().manual_seed(1234)
    saved, runs = {n: p.detach().clone() for n, p in ps.items()}, []
    nudge = lambda t: torch.nextafter(t, t.new_full(t.shape, torch.inf).where(torch.rand(t.shape, generator=gen) < 0.5, -torch.inf))
    for i in range(5):  # run 0 as is, then 4 nudged
        with torch.no_grad():
            for n, p in ps.items():
                p.copy_(nudge(saved[n]) if i else saved[n])
                p.grad = None
        loss = loss_fn(model(nudge(x) if i and x.is_floating_point() else x), y)
        loss.backward()
        runs.append({"loss": loss.detach(), **{n: p.grad for n, p in ps.items()}})
    with torch.no_grad():
        for n, p in ps.items():
            p.copy_(saved[n])
    return {n: max((r[n] - t).abs().max().item() for r in runs[1:]) for n, t in runs[0].items() if t is not None and t.numel()}'''

_PARTIAL = '''def partial_error(grad, g):
    """A grad left Partial (unreduced) is summed again by each optimizer op that reads it, in its own order:
    per element its relative error, (2n - 1) u sum|partials| / |g| over n partials; None if not Partial."""
    if not isinstance(grad, DTensor) or not any(pl.is_partial() for pl in grad.placements):
        return None
    mesh = grad.device_mesh
    n = math.prod(mesh.size(d) for d, pl in enumerate(grad.placements) if pl.is_partial())
    parts = DTensor.from_local(grad.to_local().abs(), mesh, grad.placements, shape=grad.shape, stride=grad.stride())
    return (2 * n - 1) * U * parts.full_tensor() / g.abs().clamp_min(torch.finfo(g.dtype).tiny)

def slack(rel, n, t):  # what such a grad's error may move t by (an optimizer reads a grad up to 4 times)
    return 4 * rel[n] * t.abs() if n in rel and t is not None and t.shape == rel[n].shape else 0.0'''

_NO_PARTIAL = '''def slack(rel, n, t):  # (no grad is left Partial here: nothing to add)
    return 0.0'''


def _steps(case: Case) -> str:
    rows = []
    for s in case.schedule:
        fields = [f"set_to_none={s.set_to_none}"]
        fields += [f"freeze={list(s.freeze)!r}"] if s.freeze else []
        fields += [f"unfreeze={list(s.unfreeze)!r}"] if s.unfreeze else []
        rows.append(f"dict({', '.join(fields)})")
    return "STEPS = [" + ", ".join(rows) + "]"


def _main(case: Case) -> str:
    o = case.optim
    flags = any(s.freeze or s.unfreeze for s in case.schedule)
    names = ", mesh_dim_names=(\"d0\", \"d1\")" if case.target == "fsdp2" and len(case.mesh_shape) == 2 else ""
    before = ""  # a helper for what changes before a step, where the case has any
    if flags or o.added_at:
        before = "def before_step(model, opt, k, step):  # the step's " + \
                 " and ".join(["freezes and unfreezes"] * flags + ["param groups added mid-run"] * bool(o.added_at))
        if flags:
            before += ("\n    for n in step.get(\"freeze\", []) + step.get(\"unfreeze\", []):"
                       "\n        model.get_parameter(n).requires_grad_(n in step.get(\"unfreeze\", []))")
        if o.added_at:
            before += (f"\n    for g in param_groups(model)[{len(case.groups) - o.added_groups}:] if k == {o.added_at} else []:"
                       "\n        opt.add_param_group(g)")
        before += "\n\n"
    call = ["    before_step(sharded, opt_s, k, step)"] if before else []
    lines = ["ap = argparse.ArgumentParser()",
             "ap.add_argument(\"--setup\", help=\"a Python file run first (a patch of torch, e.g. a planted bug)\")",
             "if setup := ap.parse_args().setup:",
             "    exec(compile(open(setup).read(), setup, \"exec\"), {\"__name__\": \"__setup__\", \"__file__\": setup})",
             "torch.set_num_threads(1)",
             "dist.init_process_group(\"gloo\", timeout=datetime.timedelta(seconds=120))  # a hang fails",
             f"mesh = init_device_mesh(\"cpu\", {tuple(case.mesh_shape)}{names})",
             "plain, sharded = build(), shard(build(), mesh)"]
    if case.frozen:
        lines += [f"for n in {list(case.frozen)!r}:  # frozen from the start",
                  "    for model in plain, sharded:", "        model.get_parameter(n).requires_grad_(False)"]
    lines += ["opt_p, opt_s = make_optimizer(plain), make_optimizer(sharded)",
              "# the sharded run: after the constructor and after each step its full params, state and groups,",
              "# and each step's loss and grads",
              "after, got, rel = [snapshot(sharded, opt_s)], [], []",
              "for k, step in enumerate(STEPS):", *call,
              "    opt_s.zero_grad(set_to_none=step[\"set_to_none\"])",
              "    x, y = batch(k)"]
    if case.target == "dtensor":
        rep = ", ".join(["Replicate()"] * len(case.mesh_shape))
        lines += [f"    loss = loss_fn(sharded(distribute_tensor(x, mesh, [{rep}])), distribute_tensor(y, mesh, [{rep}]))",
                  "    loss.backward()",
                  "    got.append({\"loss\": full(loss), **{n: full(p.grad) for n, p in sharded.named_parameters()}})",
                  "    rel.append({n: r for n, p in sharded.named_parameters() if (r := partial_error(p.grad, got[k][n])) is not None})"]
    else:
        lines += ["    r, per = dist.get_rank(), x.shape[0] // dist.get_world_size()  # each rank: its slice of the batch",
                  "    loss = loss_fn(sharded(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])",
                  "    loss.backward()",
                  "    dist.all_reduce(loss := loss.detach().double())  # the whole batch's mean loss",
                  "    got.append({\"loss\": (loss / dist.get_world_size()).to(DTYPE),"
                  " **{n: full(p.grad) for n, p in sharded.named_parameters()}})",
                  "    rel.append({})  # FSDP2 reduces each grad once, before the step"]
    lines += ["    opt_s.step()",
              "    after.append(snapshot(sharded, opt_s))",
              "# the plain model replays each step from the sharded run's state before it",
              "fail = check_state(\"after the constructor:\", after[0][1], snapshot(plain, opt_p)[1])",
              "for k, step in enumerate(STEPS):",
              "    if any(fail):", "        break", *[c.replace("sharded, opt_s", "plain, opt_p") for c in call],
              "    load(plain, opt_p, after[k][0], got[k - 1] if k else {}, after[k][1])",
              "    opt_p.zero_grad(set_to_none=step[\"set_to_none\"])",
              "    x, y = batch(k)",
              "    ref = loss_fn(plain(x), y)", "    ref.backward()",
              "    want = {\"loss\": ref.detach(), **{n: p.grad for n, p in plain.named_parameters()}}",
              "    # where they differ, again with each result's measured sensitivity (it only widens the bound)",
              "    sens = sensitivity(plain, x, y) if any(check(\"\", got[k][n], want[n], SUM_TOL) for n in want) else {}",
              "    fail = [check(f\"step {k} {n}\", got[k][n], want[n], SUM_TOL, sens.get(n, 0.0)) for n in want]",
              "    with torch.no_grad():  # the plain optimizer steps from the sharded grads: only the step is compared",
              "        for n, p in plain.named_parameters():",
              "            p.grad = None if got[k][n] is None else got[k][n].clone()",
              "    opt_p.step()",
              "    (params, state, groups), (_, want_state, want_groups) = after[k + 1], snapshot(plain, opt_p)",
              "    fail += [check(f\"step {k} param {n}\", params[n], p.detach(), STEP_TOL,",
              "                   extra=slack(rel[k], n, p.detach() - after[k][0][n])) for n, p in plain.named_parameters()]",
              "    fail += check_state(f\"step {k}\", state, want_state, rel[k])",
              "    if groups != want_groups:",
              "        fail.append(f\"step {k} param_groups: sharded {groups}, plain {want_groups}\")",
              "fail = [f for f in fail if f]",
              "if dist.get_rank() == 0:",
              "    print(\"\\n\".join([\"FINDING: the sharded run differs from the plain one\", *fail]) if fail else",
              "          \"PASS: the sharded run matches the plain one\")",
              "return fail"]
    return _steps(case) + "\n\n" + before + "def main():\n" + "\n".join("    " + ln for ln in lines)


_END = '''if __name__ == "__main__":
    fail = main()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if fail else 0)  # skip interpreter teardown: gloo's threads can abort the process there'''
