"""What every target's script shares: Python literals of a Case's values, the
model as nn modules, the data, the optimizer, the training loop. Each function
returns lines of code (no trailing newline) for the caller to place."""
from __future__ import annotations

import inspect
import math

import torch

from ..case import Case, Layer
from ..kernel.model import out_dim, param_shapes, token_targets
from ..kernel.optim import _TUPLE_KWARGS  # kwargs torch documents as tuples (a Case holds lists)

ACTS = {"relu": "nn.ReLU()", "gelu": "nn.GELU()", "tanh": "nn.Tanh()", "silu": "nn.SiLU()"}
WRAPPED = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # what wrappers add to a param's name


def walk(layers):
    for layer in layers:
        yield layer
        yield from walk(layer.children)


def literal_ok(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and literal_ok(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(literal_ok(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def lit(value, key: str = "") -> str:
    """A Python literal of a JSON value; the kwargs torch documents as tuples as tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, (list, tuple)):
        items = [lit(v) for v in value]
        if key in _TUPLE_KWARGS:
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        return f"[{', '.join(items)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {lit(v, k)}" for k, v in value.items()) + "}"
    return repr(value)


def indent(lines: list[str], n: int = 4) -> list[str]:
    return [" " * n + ln if ln else ln for ln in lines]


# ---- the model and the data ------------------------------------------------

def _layer(layer: Layer) -> str:
    k, nobias = layer.kind, "" if layer.bias else ", bias=False"
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
        return ACTS[layer.act]
    if k == "dropout":
        return f"nn.Dropout({layer.p})"
    if k == "moe":  # kernel/moe.py's MoE, as the script's MoE class writes it (MOE_KEYS it takes: MOE_WRITTEN)
        return f"MoE({layer.d_in}, **{lit(layer.moe)})"
    return {"seq": "nn.Sequential", "residual": "Residual", "twice": "Twice"}[k] + f"({inner})"


_CLASSES = {
    "conv1d": ["class Conv(nn.Module):  # Conv1d over the sequence axis of a [batch, seq, features] activation",
               "    def __init__(self, *args, **kwargs):", "        super().__init__()",
               "        self.conv = nn.Conv1d(*args, **kwargs)", "    def forward(self, x):",
               "        return self.conv(x.transpose(1, 2)).transpose(1, 2)"],
    "residual": ["class Residual(nn.Module):  # x + f(x)", "    def __init__(self, *layers):", "        super().__init__()",
                 "        self.inner = nn.Sequential(*layers)", "    def forward(self, x):", "        return x + self.inner(x)"],
    "twice": ["class Twice(Residual):  # f(f(x)): one module called twice, its params get two grad contributions",
              "    def forward(self, x):", "        return self.inner(self.inner(x))"],
}


# kernel/moe.py's MoE as a script writes it: dropless, no aux loss, no routing bias, the experts' for-loop (the
# keys it takes); its params made in the kernel's order under the seed (experts w1, w2, w3; the gate; the shared
# expert), its forward the kernel's ops. Experts that are DTensors (expert parallelism) compute on their shard
MOE_WRITTEN = {"experts", "hidden", "top_k", "score", "route_norm", "route_scale", "shared"}
_CLASSES["moe"] = [
    "class Experts(nn.Module):  # GroupedExperts: w1, w3 [E, hidden, dim], w2 [E, dim, hidden], over tokens sorted by expert",
    "    def __init__(self, dim, hidden, E):",
    "        super().__init__()",
    "        for n, s, fan in ((\"w1\", (E, hidden, dim), dim), (\"w2\", (E, dim, hidden), hidden), (\"w3\", (E, hidden, dim), dim)):",
    "            setattr(self, n, nn.Parameter(nn.init.uniform_(torch.empty(s), -1 / math.sqrt(fan), 1 / math.sqrt(fan))))",
    "    def forward(self, x, counts):  # SwiGLU per expert over its run of tokens (under EP: this rank's experts)",
    "        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))",
    "        return torch.cat([(nn.functional.silu(xe @ w1[e].mT) * (xe @ w3[e].mT)) @ w2[e].mT for e, xe in enumerate(x.split(counts.tolist()))])",
    "class MoE(nn.Module):  # torchtitan's MoE (fuzzshard's kernel/moe.py), dropless: top-k router, experts, shared expert",
    "    def __init__(self, dim, experts=2, hidden=1, top_k=1, score=\"softmax\", route_norm=False, route_scale=1.0, shared=0):",
    "        super().__init__()",
    "        self.experts, self.router = Experts(dim, hidden, experts), nn.Sequential()",
    "        self.router.add_module(\"gate\", nn.Linear(dim, experts, bias=False))  # router(x): the gate's logits",
    "        self.shared_experts = nn.ModuleDict({n: nn.Linear(*d, bias=False) for n, d in ((\"w1\", (dim, shared)), (\"w2\", (shared, dim)), (\"w3\", (dim, shared)))}) if shared else None",
    "        self.E, self.k, self.score, self.norm, self.scale = experts, top_k, score, route_norm, route_scale",
    "    def forward(self, h):",
    "        x = h.reshape(-1, D := h.shape[-1])",
    "        s = self.router(x).to(torch.float64 if x.dtype == torch.float64 else torch.float32)",
    "        s = torch.sigmoid(s) if self.score == \"sigmoid\" else torch.softmax(s, dim=-1)",
    "        top = s.gather(-1, idx := torch.topk(s, k=self.k, dim=-1, sorted=False)[1])",
    "        top = (top / (top.sum(dim=-1, keepdim=True) + 1e-20) if self.norm else top) * self.scale",
    "        sc = top.reshape(-1)[order := torch.argsort(idx.reshape(-1), stable=True)]  # the (token, k) slots by expert",
    "        routed = (x[order // self.k].to(sc.dtype) * sc.reshape(-1, 1)).to(x.dtype)  # scored before the experts",
    "        out = self.experts(routed, torch.bincount(idx.reshape(-1), minlength=self.E))  # EP: there and back",
    "        y = out.new_zeros(x.shape[0] * self.k, D).index_put((order,), out).reshape(-1, self.k, D).sum(dim=1)",
    "        y = y if (f := self.shared_experts) is None else f[\"w2\"](nn.functional.silu(f[\"w1\"](x)) * f[\"w3\"](x)) + y",
    "        return y.reshape(h.shape)"]


# where the MoE sees DTensor activations (a target whose Spec.moe says "local": the kernel's MoE._forward_local), the
# layer runs on full plain copies of its params and input, its output a replicated DTensor
_MOE_LOCAL = [
    "        if isinstance(h, DTensor):  # DTensor params and input: the layer on full plain copies, its output replicated",
    "            full = {n: q.full_tensor() if isinstance(q, DTensor) else q for n, q in self.named_parameters()}",
    "            return DTensor.from_local(torch.func.functional_call(self, full, (h.full_tensor(),)), h.device_mesh, run_check=False)"]


def has_moe(case: Case) -> bool:
    """Whether the case's model holds an MoE layer (a topology's, or the decoder's blocks')."""
    return any(layer.kind == "moe" for layer in walk(case.model.layers)) or bool(case.model.sizes.get("moe"))


def moe_local(case: Case) -> bool:
    """Whether the case's MoE layers see DTensor activations (MoE._forward_local): its target's Spec.moe "local"."""
    from .. import targets

    return bool((targets.get(case.target).spec.moe or {}).get("local"))


def _moe_class(case: Case) -> list[str]:
    lines = _CLASSES["moe"]
    at = lines.index("    def forward(self, h):") + 1
    return lines[:at] + (_MOE_LOCAL if moe_local(case) else []) + lines[at:]


def model(case: Case, builds: int) -> list[str]:
    """The classes, and ``build(seed)`` (or ``model = ...`` where it is built once):
    the kernel's init, bit for bit (the same modules in the same order under the same seed)."""
    spec = case.model
    dtype = case.target_options.get("built_as", case.dtype)
    if spec.factory == "decoder":
        return decoder(spec.sizes) + ["", *_build("Decoder()", dtype)]
    if spec.factory:  # a plugin's model: its own factory, called with the drawn sizes
        return _build(f"MODELS[{spec.factory!r}](**{lit(spec.sizes)})", dtype)
    kinds = {layer.kind for layer in walk(spec.layers)}
    out = []
    for k in ("conv1d", "residual", "twice", "moe"):
        if k in kinds or (k == "residual" and "twice" in kinds):
            out += (_moe_class(case) if k == "moe" else _CLASSES[k]) + [""]
    out += ["class Net(nn.Module):", "    def __init__(self):", "        super().__init__()",
            "        self.layers = nn.Sequential(" + ", ".join(_layer(x) for x in spec.layers) + ")"]
    result = "self.layers(x)"
    if spec.tie_head:
        emb = spec.layers[0]
        out += [f"        self.head = nn.Linear({emb.d_out}, {emb.d_in}, bias=False)",
                "        self.head.weight = self.layers[0].weight  # tied: one Parameter in two modules"]
        result = f"self.head({result})"
    if spec.unused:
        out.append("        self.unused = nn.Linear(2, 3)  # never called: its params get no grad")
    if spec.buffer:
        out.append(f"        self.register_buffer(\"scale\", torch.rand({out_dim(spec)}) + 0.5)")
        result = f"{result} * self.scale"
    out += ["    def forward(self, x):", f"        return {result}", ""]
    return out + _build("Net()", dtype)


def _build(make: str, dtype: str) -> list[str]:
    """The kernel's build_model: made on the CPU under the seed, then moved to the device and dtype."""
    return ["def build(seed):  # the same seed, the same initial params", "    torch.manual_seed(seed)",
            f"    return {make}.to(device, torch.{dtype})"]


def decoder(sizes: dict) -> list[str]:
    """The built-in decoder transformer (kernel/decoder.py) for these sizes only: torchtitan's Llama module
    names, its modules made in the kernel's order (the same init under the same seed)."""
    n_heads, head_dim, half = sizes["n_heads"], sizes["head_dim"], sizes["head_dim"] // 2
    dim, rep, norm = n_heads * head_dim, n_heads // sizes["n_kv_heads"], \
        "nn.RMSNorm" if sizes["norm"] == "rms" else "nn.LayerNorm"
    swiglu = sizes["mlp"] == "swiglu"
    out = []
    if half:
        out += ["def rotary(x):  # rotary position embedding over [B, L, H, D]: features (i, i + D//2) rotate in pairs",
                "    B, L, H, D = x.shape",
                "    pos = torch.arange(L, dtype=x.dtype, device=x.device)[:, None]",
                f"    freqs = 1.0 / (10000 ** (torch.arange({half}, dtype=x.dtype, device=x.device) / {half}))",
                "    angle = (pos * freqs)[None, :, None, :]",
                f"    x1, x2, rest = x[..., :{half}], x[..., {half}:{2 * half}], x[..., {2 * half}:]",
                "    cos, sin = angle.cos(), angle.sin()",
                "    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)", ""]
    qkv = "q, k = rotary(q), rotary(k)" if half else ""
    if rep > 1:
        qkv += ("; " if qkv else "") + f"k, v = k.repeat_interleave({rep}, dim=2), v.repeat_interleave({rep}, dim=2)"
    kv = sizes["n_kv_heads"] * head_dim
    p = sizes.get("dropout", 0.0)  # attention and residual dropout (F.dropout: what nn.Dropout calls)
    drop = (lambda e: f"F.dropout({e}, {p})") if p else (lambda e: e)
    out += ["class Attention(nn.Module):", "    def __init__(self):", "        super().__init__()",
            "        self.wq, self.wk, self.wv, self.wo = (nn.Linear(a, b, bias=False) for a, b in "
            f"[({dim}, {dim}), ({dim}, {kv}), ({dim}, {kv}), ({dim}, {dim})])", "    def forward(self, x):",
            "        B, L, _ = x.shape",
            f"        q, k, v = (w(x).view(B, L, -1, {head_dim}) for w in (self.wq, self.wk, self.wv))",
            *([f"        {qkv}"] if qkv else []),
            "        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)"
            + (", is_causal=True" if sizes["causal"] else "") + (f", dropout_p={p})" if p else ")"),
            f"        return {drop('self.wo(out.transpose(1, 2).reshape(B, L, -1))')}", "",
            "class FeedForward(nn.Module):", "    def __init__(self):", "        super().__init__()",
            (f"        self.w1, self.w3, self.w2 = (nn.Linear(a, b, bias=False) for a, b in "
             f"[({dim}, {sizes['hidden']}), ({dim}, {sizes['hidden']}), ({sizes['hidden']}, {dim})])" if swiglu else
             f"        self.w1, self.w2 = nn.Linear({dim}, {sizes['hidden']}, bias=False), "
             f"nn.Linear({sizes['hidden']}, {dim}, bias=False)"), "    def forward(self, x):",
            f"        return {drop('self.w2(F.silu(self.w1(x)) * self.w3(x))')}" if swiglu else
            f"        return {drop('self.w2(F.gelu(self.w1(x)))')}", "",
            "class Block(nn.Module):  # pre-norm: x + attention(norm(x)), then x + MLP(norm(x))",
            "    def __init__(self):", "        super().__init__()",
            f"        self.attention_norm, self.attention = {norm}({dim}), Attention()",
            f"        self.ffn_norm, self.feed_forward = {norm}({dim}), FeedForward()",
            "    def forward(self, x):", "        x = x + self.attention(self.attention_norm(x))",
            "        return x + self.feed_forward(self.ffn_norm(x))", "",
            "class Decoder(nn.Module):  # torchtitan's Llama, small: token ids in, logits over the vocabulary out",
            "    def __init__(self):", "        super().__init__()",
            f"        self.tok_embeddings = nn.Embedding({sizes['d_in']}, {dim})",
            f"        self.layers = nn.ModuleDict({{str(i): Block() for i in range({sizes['n_layers']})}})",
            f"        self.norm, self.output = {norm}({dim}), nn.Linear({dim}, {sizes['d_in']}, bias=False)"]
    if sizes["tied"]:
        out.append("        self.output.weight = self.tok_embeddings.weight  # tied: one Parameter, two modules")
    return out + ["    def forward(self, tokens):", "        h = self.tok_embeddings(tokens)",
                  "        for block in self.layers.values():", "            h = block(h)", "        return self.output(self.norm(h))"]


def loss(case: Case, out: str, y: str) -> str:
    """The kernel's loss_fn of ``out`` against ``y``: cross-entropy on token targets, else mean squared error."""
    if token_targets(case.model):
        return f"F.cross_entropy({out}.flatten(0, 1), {y}.flatten(0, 1))"
    return f"(({out} - {y}) ** 2).mean()"


def retie(case: Case, expr: str = "model") -> list[str]:
    """The line that ties the head to the embedding again, where a target replaced the embedding's param."""
    if case.model.factory == "decoder":
        return [f"{expr}.output.weight = {expr}.tok_embeddings.weight  # still tied"] if case.model.sizes.get("tied") else []
    return [f"{expr}.head.weight = {expr}.layers[0].weight  # still tied"] if case.model.tie_head else []


def optim_class(case: Case) -> str:
    """torch.optim's class, or the plugin's (the script binds its name, plugin_lines)."""
    return f"torch.optim.{case.optim.name}" if hasattr(torch.optim, case.optim.name) else case.optim.name


def plugin_lines(case: Case, path: str) -> list[str]:
    """The plugin file imported by path, as ``--plugin`` runs it, against a stand-in for ``fuzzshard.plugin``
    that only records what it registers: the script needs the user's file, never fuzzshard."""
    out = [f"PLUGIN = {path!r}  # the --plugin file the finding was found with: its optimizer or model",
           "MODELS, shim = {}, types.ModuleType(\"fuzzshard.plugin\")  # a stand-in for fuzzshard.plugin: records what it registers",
           "shim.optimizer = shim.model = shim.parallelism = lambda f, *a, name=None, **k: MODELS.setdefault(name or f.__name__, f)",
           "sys.modules[\"fuzzshard\"], sys.modules[\"fuzzshard.plugin\"] = types.ModuleType(\"fuzzshard\"), shim",
           "sys.modules[\"fuzzshard\"].plugin = shim",
           "(spec := importlib.util.spec_from_file_location(\"plugin\", PLUGIN)).loader.exec_module(importlib.util.module_from_spec(spec))"]
    if not hasattr(torch.optim, case.optim.name):
        out.append(f"{case.optim.name} = MODELS[{case.optim.name!r}]  # the plugin's optimizer")
    return out


def batch(case: Case) -> list[str]:
    """The kernel's make_batch: drawn on the CPU, then moved to the device."""
    m, size = case.model, f"{case.batch}, {case.seq}"
    x = (f"torch.randint(0, {m.d_in}, ({size}), generator=g).to(device)" if m.input == "tokens"
         else f"torch.randn({size}, {m.d_in}, generator=g).to(device, torch.{case.dtype})")
    y = (f"torch.randint(0, {out_dim(m)}, ({size}), generator=g).to(device)  # the next tokens" if token_targets(m)
         else f"torch.randn({size}, {out_dim(m)}, generator=g).to(device, torch.{case.dtype})")
    return ["def batch(k):  # step k's global inputs and targets (every rank draws the same)",
            f"    g = torch.Generator().manual_seed({f'{case.seed * 1000} + ' if case.seed else ''}k + 1)",
            f"    return {x}, {y}"]


# ---- the optimizer ---------------------------------------------------------

def _defaults(name: str) -> dict:
    if not hasattr(torch.optim, name):  # a plugin's: every kwarg written out
        return {}
    try:
        sig = inspect.signature(getattr(torch.optim, name).__init__)
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def _same(default, v) -> bool:
    """A value that behaves as the default does (a list for a tuple, 0.0 for 0; never a bool for a number)."""
    if isinstance(default, bool) != isinstance(v, bool) or (default is None) != (v is None):
        return False
    if isinstance(default, bool) or default is None:
        return v is default
    if isinstance(default, (tuple, list)) and isinstance(v, (tuple, list)):
        return list(default) == list(v)
    return isinstance(v, (int, float, str)) and type(default) in (int, float, str) and default == v


def kwargs(case: Case, values: dict, lr_scale: float = 1.0, all_keys: bool = False) -> list[str]:
    """``k=v`` for each kwarg unlike torch's default (``all_keys``: each, for a group's overrides)."""
    defaults = {} if all_keys else _defaults(case.optim.name)
    out = []
    for k, v in values.items():
        if k == "lr":
            v = v * lr_scale
        if k in defaults and _same(defaults[k], v) and not (k == "lr" and case.optim.tensor_lr):
            continue
        text = lit(list(v) if isinstance(v, tuple) else v, k)
        if k == "lr" and case.optim.tensor_lr:  # a tensor lr, on the CPU, as users make it
            text = f"torch.tensor({text})" if case.optim.tensor_lr == "0d" else f"torch.tensor([{text}])"
        out.append(f"{k}={text}")
    return out


def param_groups(case: Case, lr_scale: float = 1.0, p: str = "p", iterator: bool = False) -> tuple[str, str]:
    """(the first argument of the constructor, the groups added after it, as a list literal or "")."""
    pick = (lambda n: f"({n!r}, {p}[{n!r}])") if case.optim.named else (lambda n: f"{p}[{n!r}]")
    groups = []
    for g in case.groups:
        params = "[" + ", ".join(pick(n) for n in g.params) + "]"
        if iterator:
            params = f"iter({params})"
        extra = kwargs(case, g.overrides, lr_scale, all_keys=True)
        groups.append("{" + ", ".join([f"\"params\": {params}"] + [f"{e.split('=', 1)[0]!r}: {e.split('=', 1)[1]}"
                                                                     for e in extra]) + "}" if extra or len(case.groups) > 1 or iterator else params)
    n = len(groups) - case.optim.added_groups
    first = groups[0] if len(groups) == 1 and not groups[0].startswith("{") else "[" + ", ".join(groups[:n]) + "]"
    return first, ("[" + ", ".join(groups[n:]) + "]") if n < len(groups) else ""


def optimizer(case: Case, lr_scale: float = 1.0, cls: str = "", names: str = "model.named_parameters()",
              extra: str = "", iterator: bool = False) -> list[str]:
    """``opt = torch.optim.X(...)`` over the case's groups (``p``: params by plain FQN); groups added right
    after the constructor go in through add_param_group."""
    first, added = param_groups(case, lr_scale, iterator=iterator)
    cls = cls or optim_class(case)
    whole = len(case.groups) == 1 and not case.groups[0].overrides and not case.optim.named and not iterator \
        and list(case.groups[0].params) == list(param_shapes(case.model)) and names == "model.named_parameters()"
    if whole:  # every param, in the model's order
        args = ", ".join(["model.parameters()", *([extra] if extra else []), *kwargs(case, case.optim.kwargs, lr_scale)])
        return [f"opt = {cls}({args})"]
    args = ", ".join([first, *([extra] if extra else []), *kwargs(case, case.optim.kwargs, lr_scale)])
    out = [f"p = dict({names})" if "_wrapped_module" not in names else f"p = {names}",
           f"opt = {cls}({args})"]
    if added and not case.optim.added_at:
        out += [f"for g in {added}:  # added after the constructor", "    opt.add_param_group(g)"]
    return out


def plain_names(expr: str = "model") -> str:
    """{plain FQN: param} of a model whose wrappers add to the names."""
    return f"{{n.replace({WRAPPED[0]!r}, '').replace({WRAPPED[1]!r}, ''): q for n, q in {expr}.named_parameters()}}"


# activation checkpointing (kernel/ac.py), written the same way by every target's script where its shard()
# calls ac_lines: the forms that keep the module where it was on every target; a CheckpointWrapper in between
# only where the writer reads plain names through it (AC_WRAPPERS: fsdp2's)
def ac_unsupported(case: Case, options: dict, w) -> str | None:
    from ..kernel import ac

    h = ac.ac_how(options)
    if h and getattr(w, "ac_unsupported", None) and w.ac_unsupported(case, options):  # a writer's own (ep's)
        return w.ac_unsupported(case, options)
    if h in ac.AC_WRAPPED and not getattr(w, "AC_WRAPPERS", False):
        return f"activation checkpointing {h!r} (a CheckpointWrapper renames the params the script reads)"
    if h and moe_local(case):
        from ..kernel.moe import moe_prefixes

        if {f + "." for f in options["ac"]} & set(moe_prefixes(case.model)):
            return "activation checkpointing of an MoE that runs on full copies (its recompute would enter it twice)"
    return None


def ac_imports(case: Case) -> list[str]:
    from ..kernel import ac

    hows = {ac.ac_how(o) for o in [case.target_options] + ([case.checkpoint.target_options] if case.checkpoint else [])}
    out = []
    if hows & {"utils", "utils_reentrant", "sac"}:
        out.append("from torch.utils.checkpoint import checkpoint as utils_checkpoint")
    if "sac" in hows:
        out += ["from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
                "from torch._functorch.partitioners import get_default_op_list"]
    if "composable" in hows:
        out.append("from torch.distributed._composable import checkpoint")
    if hows & set(ac.AC_WRAPPED):
        out += ["from functools import partial", "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper "
                "import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper"]
    return out


_SAC = ["SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,",
        "        torch.ops.aten.linear.default, torch.ops.aten.max.default}  # torchtitan's SAC: these outputs saved",
        "SAVE |= {op.default for op in get_default_op_list().compute_intensive_ops}",
        "def sac_context():  # ... but every second mm recomputed, as everything else",
        "    count = {False: 0, True: 0}",
        "    def policy(ctx, func, *args, **kwargs):",
        "        if func in (torch.ops.aten.mm.default, torch.ops.aten.linear.default):",
        "            count[ctx.is_recompute] += 1",
        "            if count[ctx.is_recompute] % 2 == 0:",
        "                return CheckpointPolicy.PREFER_RECOMPUTE",
        "        return CheckpointPolicy.MUST_SAVE if func in SAVE else CheckpointPolicy.PREFER_RECOMPUTE",
        "    return create_selective_checkpoint_contexts(policy)"]


def module(fqn: str, case: Case | None = None) -> str:
    """``model.layers[0].inner[1]`` for "layers.0.inner.1" (the decoder's blocks: ``model.layers["0"]``, a ModuleDict)."""
    key = "[\"{}\"]" if case is not None and case.model.factory == "decoder" else "[{}]"
    return "model" + "".join(key.format(p) if p.isdigit() else f".{p}" for p in fqn.split(".")) if fqn else "model"


def ac_lines(case: Case, options: dict) -> list[str]:
    """The lines that checkpoint the options' modules of ``model`` as the kernel does (kernel/ac.py: apply)."""
    from ..kernel import ac

    h = ac.ac_how(options)
    if not h:
        return []
    mods = [module(f, case) for f in options["ac"]]
    if h == "composable":
        return [f"checkpoint({m})  # composable activation checkpointing" for m in mods]
    if h == "wrapper":
        return [f"chosen = [{', '.join(mods)}]  # activation checkpointing",
                "apply_activation_checkpointing(model, check_fn=lambda m: any(m is c for c in chosen),",
                "    checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))"]
    if h == "wrapper_reentrant":
        return [f"{m} = checkpoint_wrapper({m}, checkpoint_impl=CheckpointImpl.REENTRANT)" for m in mods]
    kw = "use_reentrant=True" if h == "utils_reentrant" else "use_reentrant=False" + \
        ", context_fn=sac_context" * (h == "sac")
    return (_SAC if h == "sac" else []) + [
        f"for m in [{', '.join(mods)}]:  # activation checkpointing: each forward recomputed in backward",
        f"    m.forward = (lambda f: lambda *a: utils_checkpoint(f, *a, {kw}))(m.forward)"]
