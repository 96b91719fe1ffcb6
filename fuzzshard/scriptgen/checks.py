"""The check a finding's script ends with, written out: parity's replay on a plain copy of the model within
the kernel's bounds, the checkpoint's round trip compared exactly, every rank's copy of a replicated value bit
for bit.

``Checks`` is the half of the Writer (script.py) that writes them, by the plan's mode (``verdict_lines``); the
functions a script defines for them are the texts here (``check``: CHECK_FN, ``sensitivity``: SENSITIVITY_FN,
``replicas``: REPLICAS_FN). The bounds are the kernel's (kernel/oracles.py, kernel/reference.py), written out
with their reasons.
"""
from __future__ import annotations

import math

from ..case import Case
from .. import targets
from ..kernel import dropout
from ..kernel.model import param_shapes, reused_unit_params
from ..kernel.oracles import UNIT_ROUNDOFF, mixed_precision_tolerance, reduction_tolerance
from ..kernel.reference import reduction_length, reduction_parts, step_tolerance_for  # the kernel's bounds
from . import common, dsd, loop


def step_tolerance(case: Case) -> dict:
    """The kernel's bound of the optimizer step (reference.step_tolerance_for): the largest param's."""
    numel = max([math.prod(sh) for sh in param_shapes(case.model).values()] or [1])
    return step_tolerance_for(case, numel, targets.get(case.target))


class Checks:
    """The check's lines (the Writer's part: ``case``, ``w`` the target's writer module, ``plan``, set there)."""

    def verdict_lines(self) -> list[str]:
        c, p = self.case, self.plan
        if p["mode"] == "error":
            return ["", "if rank == 0:", "    print(\"PASS: it ran through\")", "fail = []"]
        if p["mode"] == "checkpoint":
            return self.checkpoint_check()
        if p["mode"] == "replica":
            return ["", "if rank == 0:",
                    "    print(\"\\n\".join([\"FINDING: ranks hold different copies of a replicated value\", *fail]) if fail else",
                    f"          \"PASS: every rank holds the same {self.replica_label()} (bit for bit)\")"]
        return self.parity_check()

    def replica_label(self) -> str:
        """What the finding's quantity is, in words (param_groups.lr: "lr of each param group")."""
        kind, _, key = self.plan["quantity"].partition(".")
        return {"grad": "grads", "param": "params", "state": f"{key} of each param", "clip_norm": "total grad norm",
                "loop": {"scale": "grad scaler's scale"}.get(key, "scheduler's last lrs")}.get(kind, f"{key} of each param group")

    def replicas(self, options: dict, when: str) -> list[str]:
        """The check of every rank's copy of the finding's quantity (``when``: the label's opening, a string
        literal's start), for each param or param group."""
        q = self.plan["quantity"]
        kind, _, key = q.partition(".")
        mine = {"grad": self.w.grads(self.case, options), "param": "snapshot(model, opt)[0]",
                "state": f"{{n: v for (n, k), v in snapshot(model, opt)[1].items() if k == {key!r}}}",
                "param_groups": f"{{f\"group {{i}}\": g.get({key!r}) for i, g in enumerate(snapshot(model, opt)[2])}}",
                # the training loop's (kernel/loop.py): the total norm, the scale, the lrs
                "clip_norm": "{\"total grad norm\": norm}", "loop": "{\"scale\": scaler.get_scale()}" if key == "scale"
                else "{\"get_last_lr()\": sched.get_last_lr()}"}[kind]
        label = "" if kind in ("clip_norm", "loop") else f" {key} of" if key else f" {kind}"
        return [f"fail += replicas({when}{label}\", {mine})"]

    def checkpoint_what(self) -> str:
        """What a round trip's finding is about (param, state, group, loop; "": all of it)."""
        q = "" if self.plan.get("saved") else self.plan.get("quantity", "")
        return "param" if q.startswith("loaded.param") and not q.startswith("loaded.param_groups") else \
            "state" if q.startswith("loaded.state") else "group" if q.startswith(("loaded.group", "loaded.param_groups")) \
            else "loop" if q.startswith(("loaded.lr_scheduler", "loaded.scaler")) else ""

    def keep_loop(self) -> bool:
        """Whether the round trip checks the loop's state (the scheduler's, the scaler's) saved and loaded."""
        ck = self.case.checkpoint
        return self.plan["mode"] == "checkpoint" and loop.stateful(self.case) and not self.plan.get("saved") and \
            self.checkpoint_what() in ("", "loop") and not (ck.strict and (ck.missing or ck.unexpected))

    def checkpoint_check(self) -> list[str]:
        c, ck = self.case, self.case.checkpoint
        out = ["", "# the loaded state must equal the saved one"]
        if ck.strict and (ck.missing or ck.unexpected):
            keys = ([f"without {dsd.missing_keys(c)}"] * bool(ck.missing) + ["with an unexpected key"] * ck.unexpected)
            return out + [f"fail = [\"a strict load accepted a model state dict {' and '.join(keys)} \"",
                          "        \"(load_state_dict(strict=True) refuses it)\"] if accepted else []",
                          "if rank == 0:", "    print(f\"FINDING: {fail[0]}\" if fail else \"PASS: the strict load refused it\")"]
        if ck.missing:
            out += [f"fresh = dict(build({c.seed + 1}).named_parameters())  # a non-strict load leaves these as they were",
                    f"saved[0].update({{n: fresh[n].detach() for n in {list(ck.missing)!r}}})"]
        if self.plan.get("saved"):
            return ["", "# what was saved must equal the optimizer state it was saved from", "fail = []", "if rank == 0:",
                    "    file = torch.load(f\"{ckpt}/full.pt\")[\"optim\"][\"state\"]",
                    "    fail = [f\"saved state {n}.{k}: {torch.as_tensor(v).tolist()}, the optimizer's {saved[1][n, k].tolist()}\"",
                    "            for n, s in file.items() for k, v in s.items() if not torch.equal(torch.as_tensor(v), saved[1][n, k])]",
                    "    print(\"\\n\".join([\"FINDING: the checkpoint holds other values than the optimizer\", *fail]) if fail else",
                    "          \"PASS: the checkpoint holds the optimizer's state\")"]
        what = self.checkpoint_what()
        out += ["fail = []", "if rank == 0:  # saved and loaded: (params, optimizer state, param groups)"]
        if self.keep_loop():  # ... and the scheduler's and the scaler's state
            out += loop.check_loaded()
        if what in ("", "param"):
            out += ["    fail += [f\"param {n}: saved {v.tolist()}, loaded {loaded[0][n].tolist()}\"",
                    "             for n, v in saved[0].items() if not torch.equal(v, loaded[0][n])]"]
        if what in ("", "state"):
            out += ["    names = lambda state, n: sorted(k for m, k in state if m == n)",
                    "    fail += [f\"state of {n}: saved {names(saved[1], n)}, loaded {names(loaded[1], n)}\"",
                    "             for n in sorted({m for m, _ in saved[1]} ^ {m for m, _ in loaded[1]})]",
                    "    fail += [f\"state {n}.{k}: saved {v.tolist()}, loaded {loaded[1][n, k].tolist()}\" for (n, k), v in saved[1].items()",
                    "             if (n, k) in loaded[1] and not (v.dtype == loaded[1][n, k].dtype and torch.equal(v, loaded[1][n, k]))]"]
        if what in ("", "group"):
            out += ["    fail += [f\"param group {i} {k}: saved {g[k]!r}, loaded {g2.get(k)!r}\"",
                    "             for i, (g, g2) in enumerate(zip(saved[2], loaded[2])) for k in g if g[k] != g2.get(k)]"]
        out += ["    print(\"\\n\".join([\"FINDING: the load changed what was saved\", *fail]) if fail else",
                "          \"PASS: the loaded state equals the saved one\")"]
        return out

    def plain_loss(self, net: str, x: str) -> str:
        """The kernel's objective on the plain model: the loss, or a writer's own ``objective(case, net, x)``
        where it has one (fsdp2: its non-root forward term; pp: the schedule's microbatches)."""
        if hasattr(self.w, "objective"):
            return self.w.objective(self.case, net, x)
        return common.loss(self.case, f"{net}({x})", "y")

    def dropout_replay(self) -> list[str]:
        """kernel/dropout.py's replay: each data-parallel rank's slice, in its microbatches, from the seed that
        rank drew its masks from; the mean loss (what the averaged grads are the grads of)."""
        c = self.case
        if dropout.mode(c) != "replay" or self.plan.get("what") not in ("", "grad"):
            return []
        o = c.target_options
        world = targets.get(c.target).dropout_world(o, c.world_size)
        m, per = targets.get(c.target).microbatches(o), c.batch // world
        return [f"def replayed(net, x, batch_y, k):  # dropout: each of {world} rank(s)' slice, from its seed",
                "    total = 0",
                f"    for r in range({world}):",
                f"        torch.manual_seed(({c.seed} * 1000 + k) * 1000 + r + 1)  # the seed rank r drew its masks from",
                f"        for xm, y in zip(x[{per} * r:{per} * (r + 1)].chunk({m}), batch_y[{per} * r:{per} * (r + 1)].chunk({m})):",
                f"            total = total + {self.plain_loss('net', 'xm')} / {m}",
                f"    return total / {world}"]

    def sensitive(self) -> bool:
        """Whether the grads' bound takes the one-ulp sensitivity too, as the kernel's does: in a low precision,
        where rounding inside the forward (a norm over a near-constant row) outweighs the reductions' bound."""
        return self.plan["mode"] == "parity" and self.plan.get("what") in ("", "grad") and \
            (self.case.dtype in ("bfloat16", "float16") or bool(self.case.target_options.get("mp")))

    def mixed_precision(self) -> list[str]:
        """FSDP2's MixedPrecisionPolicy replayed with the same casts, as the kernel's reference does
        (kernel/targets/fsdp2.py mixed_precision_reference), its bound the kernel's (mixed_precision_tolerance)."""
        c, o = self.case, self.case.target_options
        mp = o.get("mp")
        if not mp or self.plan.get("what") not in ("", "grad"):
            return []
        compute = mp.get("param_dtype") or c.dtype
        reduce = mp.get("reduce_dtype") or compute
        world, m = c.world_size, o.get("microbatches", 1)
        tol, per = mixed_precision_tolerance(compute, reduce, world, m), c.batch // world
        units = ", ".join(["low"] + [self.w.module(u, c).replace("model", "low", 1) for u in o.get("wrap", [])])
        # a unit the forward calls twice: FSDP2 reduces its last microbatch's grad apart (fsdp2.split_reduced)
        split = sorted(reused_unit_params(c.model, o.get("wrap", ()))) if m > 1 else []
        box = "into" if split else "acc"
        hooks = []
        if mp.get("cast_forward_inputs", True) and mp.get("param_dtype"):
            hooks.append(f"        unit.register_forward_pre_hook(lambda m, a: tuple(t.to(torch.{compute}) "
                         "if t.is_floating_point() else t for t in a))")
        if mp.get("output_dtype"):
            hooks.append(f"        unit.register_forward_hook(lambda m, a, out: out.to(torch.{mp['output_dtype']}))")
        return [f"MP_ULPS, MP_U, MP_ETA = {tol['k_ulps']}, 2.0 ** {int(math.log2(tol['u']))}, {tol['eta']!r}  "
                f"# the kernel's bound: {tol['why']}",
                f"def mp_grads(x, y):  # each rank's slice on a copy in {compute}, its grads added in {reduce}, averaged",
                "    low = copy.deepcopy(plain)",
                "    for q in low.parameters():",
                f"        q.grad, q.data = None, q.data.to(torch.{compute})",
                *([f"    for unit in [{units}]:  # FSDP2's units: the casts at each"] + hooks if hooks else []),
                "    lp, total, spread, sens = dict(low.named_parameters()), {}, {}, {}",
                f"    for r in range({world}):",
                "        acc = {}" if not split else "        acc, apart = {}, {}",
                f"        for {'i, (xm, ym)' if split else 'xm, ym'} in {'enumerate(' * bool(split)}zip(x[{per} * r:{per} * "
                f"(r + 1)].chunk({m}), y[{per} * r:{per} * (r + 1)].chunk({m})){')' * bool(split)}:"
                + "  # its microbatches" * (m > 1),
                f"            for n, v in sensitivity(low, xm, ym{f', 1 / {m}' if m > 1 else ''}).items():",
                f"                sens[n] = sens.get(n, 0.0) + v / {world}",
                "            for q in lp.values():",
                "                q.grad = None",
                f"            ({common.loss(c, 'low(xm)', 'ym')} / {m}).backward()" if m > 1 else
                f"            {common.loss(c, 'low(xm)', 'ym')}.backward()",
                "            for n, q in lp.items():",
                *([f"                into = apart if n in {tuple(split)!r} and i == {m - 1} else acc  "
                   "# FSDP2 reduces a twice-called unit's last microbatch apart"] if split else []),
                f"                if q.grad is not None and n in {box}:",
                f"                    {box}[n] += q.grad  # accumulated in place, rounded once per add",
                "                elif q.grad is not None:",
                f"                    {box}[n] = q.grad.to(torch.{reduce})",
                "                if q.grad is not None:",
                "                    spread[n] = spread.get(n, 0) + q.grad.double().abs()",
                "        for n, g in acc.items():" if not split else "        for n, g in [*acc.items(), *apart.items()]:",
                "            total[n] = total.get(n, 0) + g.double()",
                f"    return ({{n: (v / {world}).to(torch.{c.dtype}) for n, v in total.items()}}, sens,",
                f"            {{n: MP_ULPS * MP_U * v / {world} for n, v in spread.items()}})"]

    def parity_check(self) -> list[str]:
        c, p = self.case, self.plan
        red, step = reduction_tolerance(c.dtype, reduction_length(c)), step_tolerance(c)  # the kernel's bounds
        per = reduction_tolerance(c.dtype, 1)["k_ulps"]  # the kernel's ulps per summed term
        if c.model.factory or per * reduction_length(c) != red["k_ulps"]:
            red_k = str(red["k_ulps"])
        else:  # as its factors: ulps per term, batch, seq, widest dim, conv kernel, depth + 1
            red_k = " * ".join(map(str, (per, *reduction_parts(c))))
        step_u = "U" if step["u"] == UNIT_ROUNDOFF[c.dtype] else f"2.0 ** {int(math.log2(step['u']))}"
        what = p.get("what", "")
        plain = [f"GRAD_ULPS = {red_k}  # the kernel's bound: {red['why']}"] * \
            (what in ("", "grad") and not c.target_options.get("mp") or what in ("", "clip") and bool(c.clip))
        plain += [f"STEP_ULPS, STEP_U = {step['k_ulps']}, {step_u}  # the kernel's bound: {step['why']}"] * \
            (what not in ("grad", "clip"))
        plain += ["plain = build(%d)" % c.seed]
        if c.frozen:
            plain += [f"for n in {list(c.frozen)!r}:", "    plain.get_parameter(n).requires_grad_(False)"]
        opt = [ln.replace("model.", "plain.").replace("opt = ", "opt_p = ").replace("opt.add", "opt_p.add")
               for ln in common.optimizer(c)]
        opt += loop.build(c, "opt_p", "sched_p", "scaler_p", sharded=False) if what not in ("grad", "clip") else []
        steps = p["steps"]
        over = [k for k in c.scaler.overflow if k in steps] if c.scaler else []
        if over:  # an overflow step's grads are inf: none to compare (as the kernel)
            guard = lambda lines: [f"if k not in {over!r}:  # the loss overflowed: its grads are inf"] + common.indent(lines) \
                if len(steps) > 1 else [] if steps[0] in over else lines
        else:
            guard = lambda lines: lines
        body = []
        for k in steps:
            acts = [f"plain.get_parameter({n!r}).requires_grad_(False)" for n in c.schedule[k].freeze] + \
                   [f"plain.get_parameter({n!r}).requires_grad_(True)" for n in c.schedule[k].unfreeze]
            if c.optim.added_at == k and c.optim.added_groups:
                acts += [f"for g in {common.param_groups(c)[1]}:", "    opt_p.add_param_group(g)"]
            if acts:
                body += ([f"if k == {k}:"] + common.indent(acts)) if len(steps) > 1 else acts
        anchor = ["params, state, _ = after[k]  # the sharded run's state before step k",
                  "pp = dict(plain.named_parameters())",
                  "with torch.no_grad():",
                  "    for n, q in pp.items():",
                  "        q.copy_(params[n])",
                  "        q.grad = got[k - 1][n].clone() if k and got[k - 1][n] is not None else None",
                  "opt_p.state.clear()",
                  "for (n, name), v in state.items():",
                  "    opt_p.state[pp[n]][name] = v.clone() if v.dim() or name != \"step\" else v.clone().cpu()"]
        body += anchor if steps != [0] else []
        sn = [st.set_to_none for st in c.schedule]
        if what in ("", "grad") and c.target_options.get("mp"):
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)", "new, sens, extra = mp_grads(x, y)",
                     "want = {n: q.grad if n not in new else new[n] if q.grad is None else q.grad + new[n]  # FSDP2 adds to a held grad",
                     "        for n, q in plain.named_parameters()}",
                     *guard(["fail += [check(f\"step {k} grad {n}\", got[k][n], want[n], MP_ULPS, MP_U, sens.get(n, 0.0) + "
                             "MP_ETA, extra.get(n, 0.0)) for n in want]"])]
        elif what in ("", "grad") and dropout.mode(c) == "replica":
            body += ["# dropout on DTensor activations: torch promises no mask equal to the plain model's on this device,",
                     "# so the loss and grads are not compared (the step from the sharded grads is)"]
        elif what in ("", "grad") and dropout.mode(c) == "replay":
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)", "replayed(plain, x, y, k).backward()  # every rank's slice, from its seed"]
            body += loop.overflow_plain(c, steps)
            body += guard(["fail += [check(f\"step {k} grad {n}\", got[k][n], q.grad, GRAD_ULPS)  # summed in another order",
                           "         for n, q in plain.named_parameters()]"])
        elif what in ("", "grad"):
            body += ["opt_p.zero_grad()" if all(sn) else f"opt_p.zero_grad(set_to_none={sn!r}[k])",
                     "x, y = batch(k)",
                     f"{self.plain_loss('plain', 'x')}.backward()  # {getattr(self.w, 'BATCH', 'the whole batch')}"]
            sens = ", sens=sens.get(n, 0.0)" if self.sensitive() else ""
            body += ["sens = sensitivity(plain, x, y)"] * bool(sens)
            body += loop.overflow_plain(c, steps)
            body += guard([f"fail += [check(f\"step {{k}} grad {{n}}\", got[k][n], q.grad, GRAD_ULPS{sens})"
                           "  # summed in another order", "         for n, q in plain.named_parameters()]"])
        replayed, loop_checks = loop.replay(c, what) if loop.used(c) else ([], [])
        if what != "grad":
            if not (c.scaler and what != "clip"):  # (the scaler's replay sets them, scaled)
                body += ["with torch.no_grad():  # the plain optimizer steps from the sharded grads: only the step differs",
                         "    for n, q in plain.named_parameters():",
                         "        q.grad = got[k][n]"]
            body += replayed or ["opt_p.step()"]
        if what not in ("grad", "clip"):
            body += ["(params, state, groups), mine = after[k + 1], snapshot(plain, opt_p)"]
        if what in ("", "param"):
            body += [f"fail += [check(f\"step {{k}} param {{n}}\", params[n], v, STEP_ULPS, STEP_U) for n, v in mine[0].items()]"]
        if what in ("", "state"):
            body += [f"fail += [check(f\"step {{k}} state {{n}} {{s}}\", state.get((n, s)), mine[1].get((n, s)), STEP_ULPS, STEP_U)",
                     "         for n, s in sorted(set(state) | set(mine[1]))]"]
        if what in ("", "group"):
            body += ["if groups != mine[2]:",
                     "    fail.append(f\"step {k} param_groups: sharded {groups}, plain {mine[2]}\")"]
        body += loop_checks
        run = [f"k = {steps[0]}"] + body if len(steps) == 1 else [f"for k in {steps!r}:"] + common.indent(body)
        run += loop.same_norm() if what in ("", "clip") and c.clip and c.clip.how != "value" else []
        run += loop.same_scale(c) if what in ("", "loop") else []
        return ["", "# the plain model replays the step on the whole batch from the sharded run's state",
                *plain, *opt, *self.mixed_precision(), *self.dropout_replay(), "fail = []", *run, "fail = [f for f in fail if f]",
                "if rank == 0:",
                "    print(\"\\n\".join([\"FINDING: the sharded run differs from the plain one\", *fail]) if fail else",
                "          \"PASS: the sharded run matches the plain one\")"]


CHECK_FN = '''U = {u}  # unit roundoff of {dtype}

def check(what, got, want, k, u=U, sens=0.0, extra=0.0):  # None if |got - want| <= k ulps of (max|want| + |want|) + k sens + extra
    if got is None or want is None or got.shape != want.shape:
        return None if got is None and want is None else f"{what}: sharded {got}, plain {want}"
    g, w, fin = got.double(), want.double(), got.isfinite() & want.isfinite()
    if not (fin | (g == w) | (g.isnan() & w.isnan())).all():
        return f"{what}: NaN or inf in one run only"
    g, w = g.where(fin, 0), w.where(fin, 0)
    err, bound = (g - w).abs(), k * u * (w.abs().max() + w.abs()) + k * sens + extra
    if (ok := err <= bound).all():
        return None
    i = int((err - bound).where(~ok, -1).argmax())
    return (f"{what}: sharded {g.flatten()[i].item():.8g}, plain {w.flatten()[i].item():.8g} at flat index {i}, "
            f"|diff| {err.flatten()[i].item():.3g} > allowed {bound.flatten()[i].item():.3g} ({int((~ok).sum())}/{w.numel()} off)")'''

SENSITIVITY_FN = '''def sensitivity(net, x, y, scale=1.0):  # per grad: its largest move under one-ulp nudges of every param and input
    g, pp = torch.Generator().manual_seed(1234), dict(net.named_parameters())  # (as kernel/plain.py measures it)
    saved, held, out = {n: q.detach().clone() for n, q in pp.items()}, {n: q.grad for n, q in pp.items()}, {}
    nudge = lambda t: torch.nextafter(t, torch.where(torch.rand(t.shape, generator=g).to(t.device) < 0.5, float("inf"), float("-inf")).to(t.dtype))
    def run(nudged):
        with torch.no_grad():
            for n, q in pp.items():
                q.copy_(nudge(saved[n]) if nudged else saved[n])
                q.grad = None
        xin = nudge(x) if nudged and x.is_floating_point() else x
        (LOSS * scale).backward()
        return {n: q.grad for n, q in pp.items()}
    base = run(False)
    for _ in range(4):  # one draw can read 0 by chance
        out.update({n: max(out.get(n, 0.0), float((v - base[n]).abs().max())) for n, v in run(True).items()
                    if v is not None and base[n] is not None and v.numel()})
    with torch.no_grad():
        for n, q in pp.items():
            q.copy_(saved[n])
            q.grad = held[n]
    return out'''


REPLICAS_FN = '''def off(a, b):  # None where b is a copy of a bit for bit (NaN equals NaN, -0.0 equals 0.0), else how far apart
    if not (torch.is_tensor(a) and torch.is_tensor(b)):  # a hyperparameter, or a copy one rank lacks
        same = not torch.is_tensor(a) and not torch.is_tensor(b) and (a == b or a != a and b != b)
        return None if same else f"{b!r} vs {a!r}"[:200]
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{b.dtype}{tuple(b.shape)} vs {a.dtype}{tuple(a.shape)}"
    x, y = a.double(), b.double()
    d = (x - y).abs().where((x != y) & ~(x.isnan() & y.isnan()), 0)
    bad = int((d != 0).sum())
    return f"max abs diff {d.max().item():.3g} ({bad}/{d.numel()} elements)" if bad else None

def replicas(what, mine):  # every rank's copy of each value in mine, gathered: which ranks hold which copy, how far apart
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: v.detach().cpu() if torch.is_tensor(v) else v for n, v in mine.items()})
    out = []
    for n in dict.fromkeys(k for e in every for k in e):
        copies, held = [e.get(n) for e in every], {}  # held: a copy's lowest rank: the ranks holding that copy
        for r, v in enumerate(copies):
            held.setdefault(next((h for h in held if off(copies[h], v) is None), r), []).append(r)
        out += [f"{what} {n}: ranks {' vs '.join(map(str, held.values()))}: " +
                "; ".join(f"rank {h}'s copy vs rank 0's: {off(copies[0], copies[h])}" for h in list(held)[1:])] * (len(held) > 1)
    return out'''

