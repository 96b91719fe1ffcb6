"""``fuzzshard show``: a finding or case, readable by a person."""
from __future__ import annotations

import json

from ..case import Layer
from ..findings.record import Finding


def render(finding: Finding) -> str:
    c = finding.case
    lines = []
    if finding.signature:
        lines += [f"finding   {finding.signature}", f"          {finding.summary}"]
        if finding.diagnosis:
            lines.append(f"diagnosis {finding.diagnosis}")
        if finding.root_cause:
            lines.append(f"root cause {_root_cause(finding.root_cause)}")
        from ..findings.knownlist import fixed_in_note

        fixed = fixed_in_note(finding)
        if fixed:
            lines.append(f"release   {fixed}")
        if finding.environment:
            lines.append("found on  " + ", ".join(f"{k} {v}" for k, v in finding.environment.items() if v))
        lines.append("")
    whose = "the built-in" if c.model.factory == "decoder" else "the plugin's"
    lines += [
        f"target    {c.target} on {c.world_size} rank(s), mesh {c.mesh_shape}, {c.device}, {c.dtype}, seed {c.seed}",
        f"model     input {c.model.input}[{c.model.d_in}]"
        + (", tied head" if c.model.tie_head else "") + (", unused submodule" if c.model.unused else "")
        + (", buffer" if c.model.buffer else "")
        + (f", {whose} {c.model.factory}({', '.join(f'{k}={v}' for k, v in sorted(c.model.sizes.items()))})"
           if c.model.factory else ""),
    ]
    from .. import targets
    from ..kernel.model import tie_uses

    uses = tie_uses(c.model)
    if uses:  # one param, two modules: how the target shards it (Spec.tie)
        tie = targets.get(c.target).spec.tie if c.target in targets.names() else None
        lines.append(f"tie       {uses[0]}.weight is {uses[1]}.weight" + (f": {tie(c)}" if tie and tie(c) else ""))
    for i, layer in enumerate(c.model.layers):
        lines += _layer(layer, f"layers.{i}", 1)
    lines += _dropout(c)
    opt = c.optim
    lr = f" (lr as a {opt.tensor_lr} tensor)" if opt.tensor_lr else ""
    lines.append(f"optimizer {opt.name}{lr}{' with named params' if opt.named else ''}{_added(opt)}: {json.dumps(opt.kwargs, sort_keys=True)}")
    for i, g in enumerate(c.groups):
        over = f" overrides {json.dumps(g.overrides, sort_keys=True)}" if g.overrides else ""
        lines.append(f"  group {i}: {', '.join(g.params) or '(empty)'}{over}")
    if c.frozen:
        lines.append(f"frozen    {', '.join(c.frozen)}")
    lines.append(f"schedule  {len(c.schedule)} step(s), global batch {c.batch} x seq {c.seq}")
    for k, s in enumerate(c.schedule):
        extra = "".join([f", freeze {', '.join(s.freeze)}" if s.freeze else "", f", unfreeze {', '.join(s.unfreeze)}" if s.unfreeze else ""])
        lines.append(f"  step {k}: zero_grad(set_to_none={s.set_to_none}){extra}")
    lines += _loop(c)
    lines += _options("target options", c.target_options)
    lines += _ac(c.target_options)
    if c.target_options.get("sync"):  # gradient sync over microbatches (kernel/sync.py), in words
        from ..kernel.sync import describe

        lines.append(f"  (gradient sync: {describe(c.target_options, c.target)})")
    if c.target == "pp" and c.target_options.get("ep"):  # expert parallelism inside the stages, in words
        lines.append(f"  (ep: each stage's MoE experts Shard(0) over the dp dim ({c.target_options.get('dp')} ranks), their "
                     "tokens dispatched and combined by all-to-all over dp, outside the stage's FSDP2)")
    ck = c.checkpoint
    if ck:
        from .. import targets
        from ..kernel.state_io import STATE_DICT_KINDS

        how = targets.get(c.target).spec.checkpoint_kinds.get(ck.kind, ck.kind)  # each target says how
        api = "set_model_state_dict + set_optimizer_state_dict" if ck.split else "set_state_dict"
        api = f", with {api}, strict={ck.strict}" if ck.kind in STATE_DICT_KINDS else ""
        how += f", saved with dcp.async_save ({ck.async_save}) while training goes on" if ck.async_save else ""
        lines += [f"checkpoint after step {ck.after}: {how}",
                  f"  load on {ck.world_size} rank(s), mesh {ck.mesh_shape}{api}"]
        if ck.missing or ck.unexpected:
            keys = [f"without {', '.join(ck.missing)}"] * bool(ck.missing) + ["with an unexpected key"] * ck.unexpected
            lines.append(f"  the model state dict loaded {' and '.join(keys)}")
        lines += _options("  loading side's target options", ck.target_options, "  ")
        lines += _ac(ck.target_options, "  ")
    return "\n".join(lines)


def _ac(options: dict, pad: str = "") -> list[str]:
    """Activation checkpointing, said in words (kernel/ac.py); the reference trains without it."""
    from ..kernel.ac import ac_describe

    text = ac_describe(options)
    return [f"{pad}activation checkpointing: {text} (the reference: none)"] if text else []


def _loop(c) -> list[str]:
    """The training loop around the step (kernel/loop.py), each feature the case uses on a line."""
    out = []
    if c.scaler:
        s = c.scaler
        over = f", the loss made infinite at step(s) {', '.join(map(str, s.overflow))}" if s.overflow else ""
        at = s.overflow_at
        if at:  # a partial overflow (case.Overflow)
            where = f"every element of {at.param}'s grad" if at.layer else f"element {at.index} of {at.param}'s grad"
            over += f", {at.value} in {where} at step {at.step} (on the ranks that hold it)"
        out.append(f"scaler    init_scale={s.init_scale:g}, growth_factor={s.growth_factor:g}, "
                   f"backoff_factor={s.backoff_factor:g}, growth_interval={s.growth_interval}{over}")
    if c.clip:
        k = c.clip
        call = {"norm": "clip_grad_norm_", "two_part": "get_total_norm + clip_grads_with_norm_",
                "value": "clip_grad_value_", "own": "the target's own clip_grad_norm_"}.get(k.how, k.how)
        flags = "" if k.how == "value" else f", norm_type={k.norm_type}"
        flags += f", foreach={k.foreach}" if k.foreach is not None else ""
        flags += ", error_if_nonfinite=True" if k.error_if_nonfinite else ""
        out.append(f"clip      {call}({k.max_norm:g}{flags}) after backward")
    if c.lr_scheduler:
        out.append(f"lr        {_scheduler(c.lr_scheduler)}, stepped after every step")
    return out


def _scheduler(s) -> str:
    args = ", ".join(f"{k}={v}" for k, v in sorted(s.kwargs.items()))
    inner = ", ".join(_scheduler(child) for child in s.children)
    return f"{s.name}({', '.join(a for a in ([f'[{inner}]'] if inner else []) + ([args] if args else []))})"


def _root_cause(rid: str) -> str:
    """"id: its title [where it stands upstream]" (the title is short; `known --markdown` has it in full)."""
    from ..findings.rootcause import load_root_causes

    rc = load_root_causes().get(rid)
    return f"{rid}: {rc.title} [{rc.upstream_text}]" if rc else f"{rid} (not in root_causes.json)"


def _options(title: str, options: dict, pad: str = "") -> list[str]:
    if not options:
        return []
    out = [title]
    for k, v in options.items():
        if isinstance(v, dict):
            out += [f"{pad}  {k}:"] + [f"{pad}    {n}: {p}" for n, p in v.items()]
        else:
            out.append(f"{pad}  {k}: {v}")
    return out


def _layer(layer: Layer, name: str, depth: int) -> list[str]:
    pad = "  " * depth
    k = layer.kind
    if k == "act":
        return [f"{pad}{name}: {layer.act}"]
    if k == "dropout":
        return [f"{pad}{name}: Dropout(p={layer.p})"]
    if k in ("seq", "residual", "twice"):
        out = [f"{pad}{name}: {k} ({'x + f(x)' if k == 'residual' else 'f(f(x))' if k == 'twice' else 'sequence'})"]
        for j, child in enumerate(layer.children):
            out += _layer(child, f"{name}.{'inner.' if k != 'seq' else ''}{j}", depth + 1)
        return out
    if k == "moe":  # its config as drawn, then what it uses (the coverage cells)
        from ..kernel.moe import config

        c = config(layer.moe)
        routing = (f"top-{c['top_k']} of {c['experts']} experts (hidden {c['hidden']}), {c['score']}"
                   + (", route_norm" if c["route_norm"] else "") + (f", x{c['route_scale']}" if c["route_scale"] != 1 else ""))
        extra = [f"shared expert {c['shared']}" if c["shared"] else "",
                 f"capacity {c['capacity']}" if c["capacity"] is not None else "dropless",
                 f"aux {c['aux']} x{c['aux_coeff']}" if c["aux"] else "",
                 f"expert_bias step {c['bias_coeff']}" if c["bias_coeff"] is not None else "",
                 "grouped_mm" if c["grouped"] else "", "" if c["score_before_experts"] else "scored after the experts"]
        return [f"{pad}{name}: MoE({layer.d_in}): {routing}; " + ", ".join(e for e in extra if e)]
    desc = {"linear": f"Linear({layer.d_in}, {layer.d_out}, bias={layer.bias})",
            "embedding": f"Embedding({layer.d_in}, {layer.d_out})",
            "layernorm": f"LayerNorm({layer.d_in}, bias={layer.bias})",
            "conv1d": f"Conv1d({layer.d_in}, {layer.d_out}, kernel={layer.kernel}, bias={layer.bias})"}[k]
    return [f"{pad}{name}: {desc}"]


def _dropout(c) -> list[str]:
    """How a case's dropout masks are drawn and judged (kernel/dropout.py, docs/oracles.md "Dropout")."""
    from ..kernel import dropout

    how = dropout.mode(c)
    if not how:
        return []
    if how == "replay" and c.target == "pp":
        what = (f"each stage rank's masks from its own seed per step ({c.target_options.get('schedule')}: "
                "its stages' forwards in microbatch order), replayed by the reference stage after stage "
                "(loss and grads compared)")
    elif how == "replay":
        what = ("each data-parallel rank's masks from its own seed per step, replayed by the reference "
                "(loss and grads compared)")
    else:
        what = ("every rank seeded alike per step; masks on DTensor activations, which torch promises equal to "
                "no unsharded op's on this device: loss and grads not compared (the step and the replicas are)")
    return [f"dropout   p {', '.join(map(str, dropout.probabilities(c.model)))}: {what}"]


def _added(opt) -> str:
    if not opt.added_groups:
        return ""
    when = f"before step {opt.added_at}" if opt.added_at else "after the constructor"
    return f", the last {opt.added_groups} group(s) through add_param_group {when}"
