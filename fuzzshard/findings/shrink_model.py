"""The reducer's edits of a case's model (reduce.py's EDITS): drop a layer (re-fitting the widths and
renaming every FQN that names a later layer), a composite as one of its children, the model's flags, a
bias, a narrower layer, the decoder's sizes. Each pass takes ``case.to_dict()`` and yields
(what it does, the edited dict or None); an edit renames every FQN the case names (groups, frozen, flips,
the checkpoint's missing keys, both sides' target options)."""
from __future__ import annotations

import copy
from typing import Callable, Iterator

from .edit import Edit, changed_copy, smaller_sizes


# -- FQNs ---------------------------------------------------------------------

def _renamer(rules: list[tuple[str, str | None]]) -> Callable[[str], str | None]:
    """rename(fqn): the first rule whose old prefix names it (or a module above
    it) gives its new name; None: it is gone; no rule: it stays."""
    def rename(fqn: str) -> str | None:
        for old, new in rules:
            if fqn == old or fqn.startswith(old + "."):
                return None if new is None else new + fqn[len(old):]
        return fqn
    return rename


def _rename(data: dict, rules: list) -> None:
    """Every FQN of the case renamed in place: groups, frozen, flips, the
    checkpoint's missing keys and both sides' target options."""
    rename = _renamer(rules)

    def names(fqns):
        return [n for n in map(rename, fqns) if n is not None]

    for group in data["groups"]:
        group["params"] = names(group["params"])
    data["frozen"] = names(data["frozen"])
    for step in data["schedule"]:
        step["freeze"], step["unfreeze"] = names(step["freeze"]), names(step["unfreeze"])
    data["target_options"] = _rename_in(data["target_options"], rename)
    ck = data["checkpoint"]
    if ck:
        ck["missing"] = names(ck["missing"])
        ck["target_options"] = _rename_in(ck["target_options"], rename)


def _rename_in(value, rename):
    """Target options with their FQNs renamed: dict keys (dtensor placements
    keyed by param, fsdp2's TP plan by module), list items (wrapped units) and
    string values. An entry naming what is gone is dropped; strings that are no
    FQN (placements, styles) match no rule and stay."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            k, v = rename(k), _rename_in(v, rename)
            if k is not None and v is not None:
                out[k] = v
        return out
    if isinstance(value, list):
        return [x for x in (_rename_in(v, rename) for v in value) if x is not None]
    return rename(value) if isinstance(value, str) else value


def modules(shapes: dict) -> set[str]:
    """Every param FQN and every module above one."""
    return {".".join(n.split(".")[:i]) for n in shapes for i in range(1, n.count(".") + 2)}


# -- the model's layers -------------------------------------------------------

def _paths(layers: list, path: tuple = ()) -> Iterator[tuple]:
    """Index paths of every layer, outermost first."""
    for i, layer in enumerate(layers):
        yield path + (i,)
        yield from _paths(layer["children"], path + (i,))


def _locate(layers: list, path: tuple) -> tuple[list, int, str]:
    """(the list holding the layer at ``path``, its index there, its FQN)."""
    holder, fqn = layers, "layers"
    for i in path[:-1]:
        parent = holder[i]
        fqn += f".{i}" if parent["kind"] == "seq" else f".{i}.inner"  # Residual/Twice hold an ``inner`` Sequential
        holder = parent["children"]
    return holder, path[-1], f"{fqn}.{path[-1]}"


def _chain(layers: list, d: int) -> int | None:
    """Set each layer's d_in to what the one before gives, from width ``d``;
    the output width (None: they cannot chain)."""
    for layer in layers:
        kind = layer["kind"]
        if kind in ("linear", "conv1d"):
            layer["d_in"], d = d, layer["d_out"]
        elif kind == "layernorm":
            if d < 2:  # over one feature it outputs its bias: grads are rounding noise (strategies/models.py)
                return None
            layer["d_in"] = layer["d_out"] = d
        elif kind == "seq":
            d = _chain(layer["children"], d)
            if d is None:
                return None
        elif kind in ("residual", "twice"):  # x + f(x), f(f(x)): the body maps d to d
            if not _fit(layer["children"], d, d):
                return None
            layer["d_in"] = layer["d_out"] = d
        elif kind not in ("act", "dropout"):  # an embedding takes token ids: only as the first layer
            return None
    return d


def _fit(layers: list, d: int, want: int) -> bool:
    """Chain ``layers`` from width ``d`` to width ``want``, resizing the last
    Linear or Conv1d of this level if it must."""
    out = _chain(layers, d)
    if out == want:
        return True
    resizable = [layer for layer in layers if layer["kind"] in ("linear", "conv1d")]
    if out is None or not resizable:
        return False
    resizable[-1]["d_out"] = want
    return _chain(layers, d) == want


def _rechain(model: dict) -> bool:
    """Re-fit every d_in of a topology to the layer before; False where it cannot chain."""
    layers, d = model["layers"], model["d_in"]
    if model["input"] == "tokens":
        if not layers or layers[0]["kind"] != "embedding":
            return False
        layers[0]["d_in"], d = d, layers[0]["d_out"]
        layers = layers[1:]
    if model["tie_head"]:  # the head maps the embedding's width back to the vocabulary
        return model["input"] == "tokens" and _fit(layers, d, d)
    return _chain(layers, d) is not None


def _model_edit(data: dict, change: Callable[[dict], None], rules: list = ()) -> dict | None:
    """A copy of ``data`` with ``change(model)`` made, the widths re-chained and the FQNs renamed."""
    new = copy.deepcopy(data)
    change(new["model"])
    if not _rechain(new["model"]):
        return None
    _rename(new, list(rules))
    return new


def _shift(prefix: str, i: int, n: int) -> list:
    """Rules: the i-th of n siblings under ``prefix`` is gone, the later ones move up by one."""
    return [(f"{prefix}.{i}", None)] + [(f"{prefix}.{k}", f"{prefix}.{k - 1}") for k in range(i + 1, n)]


def layer_drops(data: dict) -> Iterator[Edit]:
    """Drop a layer (a composite keeps one child at least), or replace a composite by one of its children."""
    if data["model"].get("factory"):
        return
    for path in list(_paths(data["model"]["layers"])):
        holder, i, fqn = _locate(data["model"]["layers"], path)
        layer, prefix = holder[i], fqn.rsplit(".", 1)[0]
        if len(path) == 1 or len(holder) > 1:
            yield f"drop layer {fqn}", _model_edit(data, lambda m, p=path: _pop(m, p), _shift(prefix, i, len(holder)))
        inner = fqn if layer["kind"] == "seq" else f"{fqn}.inner"
        for j, child in enumerate(layer["children"]):
            yield (f"{fqn}: {layer['kind']} -> its child {child['kind']}",
                   _model_edit(data, lambda m, p=path, j=j: _to_child(m, p, j), [(f"{inner}.{j}", fqn), (fqn, None)]))


def _pop(model: dict, path: tuple) -> None:
    holder, i, _ = _locate(model["layers"], path)
    layer = holder.pop(i)
    if path == (0,) and layer["kind"] == "embedding":  # the model then takes the embedding's floats
        model["input"], model["d_in"] = "features", layer["d_out"]


def _to_child(model: dict, path: tuple, j: int) -> None:
    holder, i, _ = _locate(model["layers"], path)
    holder[i] = holder[i]["children"][j]


def _set(model: dict, path: tuple, **fields) -> None:
    holder, i, _ = _locate(model["layers"], path)
    holder[i].update(fields)


def model_flags(data: dict) -> Iterator[Edit]:
    """Untie the head, drop the unused submodule, drop the buffer."""
    model = data["model"]
    if model["tie_head"]:
        yield "untie the head", _model_edit(data, lambda m: m.update(tie_head=False))
    if model["unused"]:
        yield "drop the unused submodule", _model_edit(data, lambda m: m.update(unused=False), [("unused", None)])
    if model["buffer"]:
        yield "drop the buffer", _model_edit(data, lambda m: m.update(buffer=False))


def layer_details(data: dict) -> Iterator[Edit]:
    """A bias less, a narrower layer (the next one re-fitted), a kernel of 1, a narrower input."""
    model = data["model"]
    if model.get("factory"):
        return
    for path in list(_paths(model["layers"])):
        holder, i, fqn = _locate(model["layers"], path)
        layer = holder[i]
        if layer["bias"] and layer["kind"] in ("linear", "conv1d", "layernorm"):
            bias = f"{fqn}.conv.bias" if layer["kind"] == "conv1d" else f"{fqn}.bias"
            yield f"no bias in {fqn}", _model_edit(data, lambda m, p=path: _set(m, p, bias=False), [(bias, None)])
        if layer["kind"] in ("linear", "conv1d", "embedding"):
            for w in smaller_sizes(layer["d_out"]):
                yield (f"{fqn} width {layer['d_out']} -> {w}",
                       _model_edit(data, lambda m, p=path, w=w: _set(m, p, d_out=w)))
        if layer["kind"] == "conv1d" and layer["kernel"] > 1:
            yield f"{fqn} kernel {layer['kernel']} -> 1", _model_edit(data, lambda m, p=path: _set(m, p, kernel=1))
    what = "vocabulary" if model["input"] == "tokens" else "input width"
    for w in smaller_sizes(model["d_in"]):
        yield f"{what} {model['d_in']} -> {w}", _model_edit(data, lambda m, w=w: m.update(d_in=w))


def decoder_edits(data: dict) -> Iterator[Edit]:
    """The decoder transformer's sizes: a block less, one head, narrower dims, RMSNorm, untied."""
    model = data["model"]
    if model.get("factory") != "decoder":
        return
    sizes = model["sizes"]

    def resized(**changes) -> dict:
        new = changed_copy(data)
        new["model"]["sizes"].update(changes)
        new["model"]["d_in"] = new["model"]["sizes"]["d_in"]  # the vocabulary, said twice
        return new

    n = sizes["n_layers"]
    for i in range(n) if n > 1 else ():
        new = resized(n_layers=n - 1)
        _rename(new, _shift("layers", i, n))
        yield f"drop block layers.{i}", new
    if sizes["n_heads"] > 1:
        heads = f"heads {sizes['n_heads']}/{sizes['n_kv_heads']}"
        yield f"{heads} -> 1/1", resized(n_heads=1, n_kv_heads=1)
        if sizes["n_kv_heads"] < sizes["n_heads"]:
            yield f"{heads} -> {sizes['n_kv_heads']}/{sizes['n_kv_heads']}", resized(n_heads=sizes["n_kv_heads"])
    for key, least in (("head_dim", 1), ("hidden", 1), ("d_in", 2)):
        for v in smaller_sizes(sizes[key], least):
            yield f"{key} {sizes[key]} -> {v}", resized(**{key: v})
    if sizes.get("norm") == "layer":
        yield "LayerNorm -> RMSNorm", resized(norm="rms")
    if sizes.get("tied"):
        yield "untie the output head", resized(tied=False)
    if sizes.get("dropout"):
        yield "no dropout", resized(dropout=0.0)
