"""The reducer (fuzzshard/findings/reduce.py): every edit is a well-formed, smaller
case, and a reduction ends 1-minimal. Pure: no process group runs."""
import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings

import fuzzshard.strategies as fst
from cases import simple_case
from fuzzshard import targets
from fuzzshard.case import Case
from fuzzshard.kernel.model import build_model, make_batch, param_shapes
from fuzzshard.findings.reduce import edits, minimize, reduce, size

TARGETS = targets.builtin()
FEW = settings(deadline=None, database=None, phases=[Phase.generate],
               suppress_health_check=list(HealthCheck))


def _fqns_in(value) -> list[str]:
    """Strings of target options that name a layer's module or param."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _fqns_in(k) + _fqns_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _fqns_in(v)]
    return [value] if isinstance(value, str) and value.startswith(("layers.", "unused.")) else []


def assert_well_formed(case: Case) -> None:
    case.check_world()
    text = case.to_json()
    assert Case.from_json(text) == case
    shapes = param_shapes(case.model)
    # every module the model has, parameter-free ones too (pp's ``wrap`` may fully_shard an activation layer)
    modules = {".".join(n.split(".")[:i]) for n in shapes for i in range(1, n.count(".") + 2)}
    modules |= {f"layers.{i}" for i in range(len(case.model.layers))}
    named = [n for g in case.groups for n in g.params] + list(case.frozen)
    named += [n for s in case.schedule for n in (*s.freeze, *s.unfreeze)]
    named += list(case.checkpoint.missing) if case.checkpoint else []
    assert set(named) <= set(shapes)
    sides = [(case.mesh_shape, case.target_options)]
    sides += [(case.checkpoint.mesh_shape, case.checkpoint.target_options)] if case.checkpoint else []
    for mesh, options in sides:
        assert set(_fqns_in(options)) <= modules, options
        for fqn, placement in options.get("placements", {}).items():  # dtensor: one per mesh dim, a dim the param has
            assert len(placement) == len(mesh) and all(p == "R" or int(p[1:]) < len(shapes[fqn]) for p in placement)
    key = json.dumps(json.loads(text)["model"], sort_keys=True)
    if key not in CHAINS:  # once per model: most edits leave it as it is
        CHAINS[key] = chains(case.model)
    assert CHAINS[key], key


CHAINS: dict[str, bool] = {}


def chains(model) -> bool:
    """The widths chain: the model builds and maps a batch to its targets' shape
    (token targets: one logit per vocabulary entry)."""
    x, y = make_batch(model, 0, 0, 1, 2, "cpu", torch.float32)
    out = build_model(model, 0, "cpu", torch.float32)(x)
    return out.shape == y.shape if y.is_floating_point() else out.shape == (*y.shape, model.d_in)


@pytest.mark.parametrize("target,models", [(t, "topologies") for t in TARGETS] + [("fsdp2", "decoder")])
def test_every_edit_is_a_well_formed_smaller_case(target, models):
    @settings(FEW, max_examples=4 if models == "decoder" else 8)  # a decoder's edits each build a model
    @given(fst.cases(target=target, world_sizes=[1, 2, 3, 4], models=(models,)))
    def check(case):
        for what, edited in edits(case):
            assert_well_formed(edited)
            assert size(edited) < size(case), what

    check()


def test_dropping_a_middle_layer_renames_every_later_fqn():
    case = simple_case(2, placements={"layers.0.weight": ["S0"], "layers.2.weight": ["S1"]})
    case = dataclasses.replace(case, frozen=("layers.2.bias",))
    by_what = dict(edits(case))
    no_act = by_what["drop layer layers.1"]
    assert [layer.kind for layer in no_act.model.layers] == ["linear", "linear"]
    assert no_act.groups[1].params == ("layers.1.weight", "layers.1.bias") and no_act.frozen == ("layers.1.bias",)
    assert no_act.target_options["placements"] == {"layers.0.weight": ["S0"], "layers.1.weight": ["S1"]}
    no_first = by_what["drop layer layers.0"]  # its params gone, the next Linear re-fitted to the input
    assert no_first.groups[0].params == () and no_first.model.layers[1].d_in == 5
    assert no_first.target_options["placements"] == {"layers.1.weight": ["S1"]}
    assert "world size 2 -> 1" in by_what and "drop step 1" in by_what and "drop param group 1 (params to group 0)" in by_what


def has_conv_and_two_steps(case: Case) -> bool:
    """A synthetic bug: some conv1d layer, anywhere, and at least two steps."""
    def convs(layers):
        return any(layer.kind == "conv1d" or convs(layer.children) for layer in layers)

    return convs(case.model.layers) and len(case.schedule) >= 2


@settings(max_examples=4, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(fst.cases(target="dtensor", world_sizes=[1, 2, 3, 4]))
def test_reduce_ends_one_minimal_with_only_what_the_bug_needs(case):
    assume(has_conv_and_two_steps(case))
    seen = []
    smallest, kept = reduce(case, has_conv_and_two_steps, on_smaller=seen.append)
    assert has_conv_and_two_steps(smallest)
    assert not any(has_conv_and_two_steps(e) for _, e in edits(smallest))  # 1-minimal
    assert len(seen) == len(kept) and (not seen or seen[-1] == smallest)
    (conv,) = smallest.model.layers
    assert (conv.kind, conv.d_in, conv.d_out, conv.kernel, conv.bias) == ("conv1d", 1, 1, 1, False)
    assert len(smallest.schedule) == 2 and smallest.world_size == 1 and smallest.checkpoint is None
    assert len(smallest.groups) == 1 and not smallest.frozen and smallest.target_options == {}
    assert (smallest.batch, smallest.seq, smallest.dtype) == (1, 1, "float32")


def test_a_spent_budget_returns_the_case_as_it_is():
    case = simple_case(2)
    assert reduce(case, lambda c: True, budget_s=0.0) == (case, [])


# -- a deliberately bloated case per family, reduced with a pure fake bug (issue 45) ------------------------------
# Each case carries every feature its target takes (a checkpoint with an async save, a grad scaler with an
# overflow step, a SequentialLR, a clip in a plain form's stead, a 1-element tensor lr, 3 ranks, layers,
# groups and steps); the fake bug needs only what a real bug of its family needed. The reduction must reach
# the minimal case: every feature the bug does not need gone, the fewest ranks, the plainest lr.
SCALER = {"init_scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "overflow": [1]}
SEQUENTIAL = {"name": "SequentialLR", "kwargs": {"milestones": [1]}, "children": [
    {"name": "LinearLR", "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 2}},
    {"name": "ExponentialLR", "kwargs": {"gamma": 0.9}}]}
TWO_PART = {"how": "two_part", "max_norm": 0.1, "norm_type": "inf", "foreach": True, "error_if_nonfinite": False}


def _linears(n: int, width: int = 3) -> dict:
    """A model of ``n`` Linear layers ``width`` wide, as a Case's dict holds it."""
    layer = {"kind": "linear", "d_in": width, "d_out": width, "bias": True, "act": "", "kernel": 1, "children": []}
    return {"input": "features", "d_in": width, "layers": [dict(layer) for _ in range(n)], "tie_head": False,
            "unused": False, "buffer": False}


def _bloated(target, world, *, model=None, groups=3, steps=3, checkpoint=None, options=None, optim="Adam",
             scheduler=SEQUENTIAL, clip=TWO_PART, scaler=SCALER) -> Case:
    model = model or _linears(5)
    params = [f"layers.{i}.{p}" for i in range(len(model["layers"])) for p in ("weight", "bias")]
    data = {"target": target, "world_size": world, "mesh_shape": [world], "model": model,
            "optim": {"name": optim, "kwargs": {"lr": 0.01, "weight_decay": 0.1, "foreach": False},
                      "tensor_lr": "1d", "named": True},
            "groups": [{"params": params[g::groups], "overrides": {"lr": 0.02} if g else {}} for g in range(groups)],
            "schedule": [{"set_to_none": bool(k % 2)} for k in range(steps)], "batch": 6, "seq": 2,
            "target_options": options or {}, "checkpoint": checkpoint, "lr_scheduler": scheduler, "clip": clip,
            "scaler": scaler}
    case = Case.from_dict(data)
    assert_well_formed(case)
    return case


def _reduced(case, bug):
    """The reduction of ``case`` under the fake ``bug``: it ends, and 1-minimal."""
    assert bug(case)
    r = minimize(case, bug)
    assert r.minimal and r.untried == 0 and bug(r.case), r.kept
    assert not any(bug(e) for _, e in edits(r.case))  # 1-minimal: no single edit keeps the bug
    assert_well_formed(r.case)
    return r.case


def _plain(case, *, but=()) -> None:
    """No loop feature the bug does not need, and the plainest lr."""
    have = {"checkpoint": case.checkpoint, "scaler": case.scaler, "lr_scheduler": case.lr_scheduler,
            "clip": case.clip, "tensor lr": case.optim.tensor_lr}
    assert [k for k, v in have.items() if v] == list(but), have


def test_a_clip_bug_loses_the_checkpoint_scaler_scheduler_and_tensor_lr_and_goes_to_one_rank():
    """The issue's clip-norm bug over DTensor grads: a norm clip of any form is all it needs."""
    ck = {"after": 0, "kind": "dcp", "world_size": 2, "mesh_shape": [2], "async_save": "pinned",
          "target_options": {"placements": {"layers.0.weight": ["S0"]}}}
    case = _bloated("dtensor", 3, checkpoint=ck, options={"placements": {"layers.0.weight": ["S0"]}}, optim="NAdam")
    small = _reduced(case, lambda c: c.clip is not None and c.clip.how in ("norm", "two_part"))
    _plain(small, but=["clip"])
    assert (small.clip.how, small.clip.norm_type, small.clip.foreach) == ("norm", "2", None)
    assert small.world_size == 1 and len(small.model.layers) == 1 and len(small.groups) == 1
    assert len(small.schedule) == 1 and small.target_options == {} and not small.optim.named


@pytest.mark.parametrize("bug, keeps", [
    # DCP saved at one world size and loaded at another (ckpt_reshard_swap): 2 ranks, the save blocking
    (lambda c: c.checkpoint is not None and c.checkpoint.world_size != c.world_size, ["checkpoint"]),
    # a scheduler's load drops last_epoch (loop_sched_load_drops_epoch): the 1-d tensor lr plays no part
    (lambda c: c.checkpoint is not None and c.lr_scheduler is not None, ["checkpoint", "lr_scheduler"]),
    # a bug of tensor lrs, any: a 0-d one is plainer than a 1-element one
    (lambda c: c.checkpoint is not None and c.optim.tensor_lr != "", ["checkpoint", "tensor lr"]),
], ids=["reshard", "scheduler-load", "tensor-lr"])
def test_a_checkpoint_bug_keeps_only_the_checkpoint_and_what_it_needs(bug, keeps):
    ck = {"after": 1, "kind": "dcp", "world_size": 2, "mesh_shape": [2], "async_save": "pinned", "split": True,
          "target_options": {}}
    small = _reduced(_bloated("dtensor", 3, checkpoint=ck), bug)
    _plain(small, but=keeps)
    assert small.checkpoint.async_save == "" and small.checkpoint.after == 0 and not small.checkpoint.split
    assert small.ranks == (2 if "tensor lr" not in keeps and "lr_scheduler" not in keeps else 1)
    if "tensor lr" in keeps:
        assert small.optim.tensor_lr == "0d"
    if "lr_scheduler" in keeps:  # SequentialLR as one of its children
        assert small.lr_scheduler.name in ("LinearLR", "ExponentialLR") and not small.lr_scheduler.children
    assert len(small.model.layers) == 1 and len(small.groups) == 1


def test_an_fsdp1_optimizer_state_bug_goes_from_3_ranks_5_layers_3_groups_to_1_of_each():
    """The issue's FSDP1 optim-state-dict finding kept 3 ranks, 5 layers and 3 groups, though 3 ranks -> 1
    kept its signature: an FSDP1 sharded optimizer state dict of Adam is all it needs."""
    ck = {"after": 0, "kind": "fsdp1_sharded", "world_size": 2, "mesh_shape": [2], "target_options": {}}
    case = _bloated("fsdp1", 3, checkpoint=ck, clip={"how": "own", "max_norm": 0.1})
    small = _reduced(case, lambda c: c.checkpoint is not None and c.checkpoint.kind == "fsdp1_sharded"
                     and c.optim.name == "Adam")
    _plain(small, but=["checkpoint"])
    assert small.ranks == 1 and len(small.model.layers) == 1 and len(small.groups) == 1 and len(small.schedule) == 1


def test_a_pipeline_schedule_bug_keeps_two_stages_and_its_schedule():
    """1F1B losing a microbatch's grads (pp_1f1b_drop_microbatch_grads): two ranks, two microbatches."""
    options = {"schedule": "1F1B", "cuts": [1, 3], "n_microbatches": 6}
    case = _bloated("pp", 3, options=options, clip=None, scaler=None, scheduler={"name": "ExponentialLR",
                                                                                 "kwargs": {"gamma": 0.9}})
    small = _reduced(case, lambda c: c.world_size >= 2 and c.target_options.get("schedule") == "1F1B"
                     and c.target_options.get("n_microbatches", 1) >= 2)
    _plain(small)
    assert small.world_size == 2 and len(small.model.layers) == 2 and len(small.groups) == 1
    assert small.target_options["n_microbatches"] == 2


def test_a_replica_bug_of_a_load_keeps_the_ranks_it_needs_and_nothing_else():
    """ZeRO's load leaving lr unrestored on every rank but 0 (zero_load_lr_one_rank), seen by the replica
    oracle: a consolidated checkpoint loaded on 2 ranks at least."""
    ck = {"after": 1, "kind": "consolidate", "world_size": 3, "mesh_shape": [3], "target_options": {}}
    case = _bloated("zero", 3, checkpoint=ck, options={"bucket_view": True})
    small = _reduced(case, lambda c: c.checkpoint is not None and c.checkpoint.world_size >= 2)
    _plain(small, but=["checkpoint"])
    assert (small.world_size, small.checkpoint.world_size) == (1, 2) and small.target_options == {}
    assert len(small.model.layers) == 1 and len(small.schedule) == 1


def test_a_reduction_out_of_budget_says_what_it_left_untried():
    case = simple_case(2)
    r = minimize(case, lambda c: True, budget_s=0.0)
    assert (r.case, r.kept, r.minimal) == (case, [], False) and r.untried == len(edits(case)) > 0
    assert r.record()["untried"] == r.untried and r.record()["minimal"] is False


def test_a_pass_tries_each_edit_once_not_once_per_edit_kept():
    """A reduction keeping K edits of a case with N costs about N runs per pass, not N per edit kept."""
    case = _bloated("dtensor", 3, checkpoint=None)
    runs = []
    r = minimize(case, lambda c: runs.append(c) or c.clip is not None)
    assert r.minimal and r.runs == len(runs)
    assert len(runs) < 3 * len(edits(case)), (len(runs), len(edits(case)), len(r.kept))


def _on_mesh_dim_of_6_or_more(case) -> bool:
    """A bug as the planted 6-rank Partial bug of test_simulate.py makes it: layers.0.weight's input dim sharded
    (Shard(1): a Partial sum) over a mesh dim of 6 ranks or more."""
    placement = case.target_options.get("placements", {}).get("layers.0.weight", [])
    return any(p == "S1" and case.mesh_shape[d] >= 6 for d, p in enumerate(placement))


def test_the_one_shrinker_takes_a_2d_mesh_to_the_1d_mesh_of_the_dim_the_bug_lives_on():
    """A simulated finding on a [2, 8] mesh whose bug lives on mesh dim 1: the reducer's world edits (the
    world pass of the one shrinker, shrink_world.py) keep that dim and its placement on a 1-D mesh of the
    fewest ranks that still fail (6), where fewer ranks on mesh dim 0's placement lose it. The session's
    reducer (every pass) and a simulated finding's least world (onset.least_worlds: the world pass alone)
    get there the same way; a checkpoint's sides keep the plain edits only."""
    from fuzzshard.findings.reduce import WORLD

    case = dataclasses.replace(simple_case(16, optim="SGD", placements={"layers.0.weight": ["R", "S1"]}),
                               mesh_shape=(2, 8))
    assert _on_mesh_dim_of_6_or_more(case)
    world = minimize(case, _on_mesh_dim_of_6_or_more, passes=WORLD)
    assert world.minimal and world.kept == ["world size 16 -> 6; mesh [2, 8] -> [6]"], world.kept
    assert (world.case.world_size, world.case.mesh_shape) == (6, (6,))
    assert world.case.target_options["placements"]["layers.0.weight"] == ["S1"]
    whole = minimize(case, _on_mesh_dim_of_6_or_more)  # every pass: the same world first, then the rest
    assert whole.minimal and whole.kept[0] == world.kept[0] and whole.case.mesh_shape == (6,)
    assert whole.case.target_options == {"placements": {"layers.0.weight": ["S1"]}}
    # fewer ranks on mesh dim 0's placements alone (a plain 1-D edit) would have lost the bug
    plain = dict(edits(case, WORLD))["world size 16 -> 6"]
    assert plain.mesh_shape == (6,) and not _on_mesh_dim_of_6_or_more(plain)
