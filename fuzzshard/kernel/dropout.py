"""Dropout under sharding: where each rank's masks come from, and what the oracles compare them to.

A dropout mask is drawn from the device's default generator at each forward. In a case with dropout
(``has_dropout``) every rank seeds that generator before each step's forward with ``seed(case.seed, step, r)``
(``draw_from``): ``r`` is the rank's index among the data-parallel ranks that each train on their own slice
of the batch (``Target.dropout_rank``), 0 where every rank runs the whole batch (pp: its row-major index on the
[pp] or [pp, dp] mesh, each stage's rank its own). What the masks are compared
to is the target's ``Spec.dropout`` (docs/oracles.md, "Dropout", says why for each):

- ``"replay"``: each rank runs a plain forward (plain tensors, the default generator, as one process does) on
  its own slice in its microbatches (FSDP2, EP, FSDP1, DDP, DDP under ZeRO), or on the whole batch (ShardedOptimizer:
  full param copies). The reference replays the same draws (``replayed``): for each data-parallel rank r its
  generator seeded as r's was, r's slice, in r's microbatches, in order; the mean of those losses. The same
  op on the same shape, dtype, device and generator state gives the same mask (a seeded generator's
  reproducibility, torch's promise within a release), so loss and grads are compared as without dropout.
  Activation checkpointing must give the recomputation the forward's mask (``preserve_rng_state``, on by
  default, restores the generator): one that draws a new mask makes grads the reference does not.
  pp replays too: a rank draws only its stages' masks, GPipe's and 1F1B's one stage in microbatch order (the
  backwards draw nothing), LoopedBFS's stages one after another, each over every microbatch. Its objective
  replays them itself (``dropout_world`` 1: ``replayed`` hands it the whole batch): the plain model cut into the
  same stages, run one after another over every microbatch, each from its rank's seed or, where the rank ran a
  stage before, from the generator as that stage left it (``state``/``restore``; pp/schedules.py
  ``replayed_stages``). The interleaved and V schedules (Interleaved1F1B, InterleavedZeroBubble,
  ZBVZeroBubble, DualPipeV) interleave several stages' draws on one rank's generator in the schedule's own
  order: refused with dropout (pp's check, ``DROPOUT_SCHEDULES``).
- ``"replica"``: the masks are drawn on DTensor activations (dtensor) or on TP's local shards (tp). A random op
  on a DTensor goes through DTensor's RNG tracker (torch/distributed/tensor/_random.py), which torch runs on
  CUDA-like devices only: on a CPU mesh ``is_rng_supported_mesh`` is False (``torch.cpu`` has no
  ``set_rng_state``; ``OffsetBasedRNGTracker`` refuses a CPU device) and each rank's local op draws from its
  own generator, so a sharded activation's mask is no slice of the unsharded op's. On CUDA torch's own tests
  (test_random_ops.py) promise the ranks of a Replicate DTensor the same mask; that a sharded mask equals the
  unsharded op's is not what this release's tracker promises either (offsets per shard, not the single-device
  stream's). The loss and grads are therefore not compared to the reference (their masks differ by design);
  the step (from the sharded run's own grads), the checkpoint and the replicas (every rank's copy of a
  replicated grad, param and state, bit for bit: ranks seeded alike draw alike) are.
- ``""``: not drawn (a target with no replay; none of the built-in ones now).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..case import Case, Model

MODES = ("replay", "replica")


def has_dropout(spec: Model) -> bool:
    """Whether a model draws masks: a dropout layer of p > 0, or a decoder with dropout."""
    if spec.factory == "decoder":
        return bool(spec.sizes.get("dropout"))
    if spec.factory:
        return False
    return any(_layers_with_dropout(spec.layers))


def _layers_with_dropout(layers):
    for layer in layers:
        if layer.kind == "dropout" and layer.p > 0:
            yield layer
        yield from _layers_with_dropout(layer.children)


def probabilities(spec: Model) -> list[float]:
    """Every dropout probability of the model (show, coverage)."""
    if spec.factory == "decoder":
        return [spec.sizes["dropout"]] if spec.sizes.get("dropout") else []
    return [layer.p for layer in _layers_with_dropout(spec.layers)]


def mode(case: Case) -> str:
    """How the case's masks are judged: "" (no dropout), "replay" or "replica" (the target's Spec)."""
    if not has_dropout(case.model):
        return ""
    from .. import targets

    return targets.get(case.target).spec.dropout if case.target in targets.names() else ""


def dropout_problem(case: Case) -> str | None:
    """Case.check's part: a probability outside [0, 1), or dropout under a target that draws none."""
    bad = [p for p in _all_p(case.model) if not 0.0 <= p < 1.0]
    if bad:
        return f"dropout probability {bad[0]}: want one in [0, 1)"
    if has_dropout(case.model) and not mode(case):
        from .. import targets

        if case.target in targets.names():
            return (f"dropout under {case.target}: its ranks' draws are not replayed by the reference "
                    f"(kernel/dropout.py)")
    if has_dropout(case.model) and mode(case) == "replay":
        from . import moe
        from .. import targets

        if any(cfg.get("aux") == "batch" for cfg in moe.moe_configs_of(case.model)) and case.target in targets.names():
            cls = targets.get(case.target)
            sides = [(case.target_options, case.world_size)]
            if case.checkpoint:
                sides.append((case.checkpoint.target_options, case.checkpoint.world_size))
            if any(cls.dropout_world(o, w) > 1 for o, w in sides):
                return (f"a batch-wise MoE aux loss with dropout under {case.target}: the reference replays each "
                        "rank's slice in a forward of its own, whose expert counts are that slice's, not the "
                        "global batch's the ranks all-reduce")
    return None


def _all_p(spec: Model) -> list[float]:
    if spec.factory == "decoder":
        p = spec.sizes.get("dropout", 0.0)
        return [p] if isinstance(p, (int, float)) else [-1.0]

    def walk(layers):
        for layer in layers:
            if layer.kind == "dropout":
                yield layer.p
            yield from walk(layer.children)

    return list(walk(spec.layers)) if not spec.factory else []


def seed(case_seed: int, step: int, rank: int) -> int:
    """The seed data-parallel rank ``rank`` draws step ``step``'s masks from."""
    return (case_seed * 1000 + step) * 1000 + rank + 1


def _seed_generator(s: int, device: str) -> None:
    # the CPU generator alone where that is all: torch.manual_seed would also queue CUDA's seeding (model.py)
    torch.random.default_generator.manual_seed(s)
    if device.startswith("cuda"):
        torch.cuda.manual_seed(s)


def draw_from(case: Case, step: int, rank: int, device: str) -> None:
    """In the sharded run, before step ``step``'s forward: this rank's generator seeded (a case with dropout only)."""
    if has_dropout(case.model):
        _seed_generator(seed(case.seed, step, rank), device)


class Draws:
    """The reference's replay of one step's draws: ``rank(r)`` seeds the generator as rank r's was;
    ``kept()`` runs a block (a sensitivity probe) and gives the generator back as it was before it."""

    def __init__(self, case: Case, step: int, device: str):
        self.case, self.step, self.device = case, step, device

    def rank(self, r: int) -> None:
        _seed_generator(seed(self.case.seed, self.step, r), self.device)

    def state(self):
        """The generator's state now (CUDA's too on a CUDA device): ``restore`` continues from it (pp's LoopedBFS:
        a rank's next stage draws where its previous one left the generator)."""
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.device.startswith("cuda") else None

    def restore(self, state) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def kept(self):
        devices = [torch.device(self.device)] if self.device.startswith("cuda") else []
        return torch.random.fork_rng(devices=devices)

    def same_masks(self, fn):
        """``fn`` drawing from the generator as it is now at every call (a sensitivity probe's passes)."""
        state = self.state()

        def run(*args, **kwargs):
            self.restore(state)
            return fn(*args, **kwargs)

        return run


_REPLAYING: list = []  # the reference step being replayed: [Draws] where its case has dropout to replay


def replay_step(case: Case | None, step: int = 0, device: str = "cpu") -> None:
    """The reference replays step ``step`` now (None: no step): where the case's masks are replayed,
    ``draws()`` says how."""
    _REPLAYING[:] = [Draws(case, step, device)] if case is not None and mode(case) == "replay" else []


@contextlib.contextmanager
def replaying(case: Case, step: int, device: str):
    """``replay_step`` around a block."""
    replay_step(case, step, device)
    try:
        yield
    finally:
        replay_step(None)


def draws() -> Draws | None:
    """The step being replayed, where its case's masks are replayed; else None."""
    return _REPLAYING[-1] if _REPLAYING else None


def replayed(objective, world: int, microbatches: int):
    """``objective(model, x, y, options)`` as the reference computes it under ``replaying``: where the masks
    are replayed, each of ``world`` data-parallel ranks' slice of the batch, in ``microbatches`` equal parts,
    from that rank's seed, the mean of their losses (what the ranks' averaged grads are the grads of);
    elsewhere the objective itself."""
    def run(model, x, y, options):
        d = draws()
        if d is None:
            return objective(model, x, y, options)
        from .moe import moe_modules

        per = x.shape[0] // world
        total = 0
        # an MoE's aux loss takes its grad in the forward (moe.py _AuxLoss), not through this mean: each of the
        # world * microbatches forwards' aux losses gets 1 / (world * microbatches) of it, the mean of theirs,
        # as the sharded ranks' averaged grads have (a sequence-wise aux loss is additive over sequences)
        mods = moe_modules(model)
        kept = [m.aux_grad for m in mods]
        for m in mods:
            m.aux_grad = m.aux_grad / (world * microbatches)
        try:
            for r in range(world):
                d.rank(r)
                for xm, ym in zip(x[r * per:(r + 1) * per].chunk(microbatches),
                                  y[r * per:(r + 1) * per].chunk(microbatches)):
                    total = total + objective(model, xm, ym, options) / microbatches
        finally:
            for m, g in zip(mods, kept):
                m.aux_grad = g
        return total / world

    return run


def dropout_coverage(case: Case) -> dict:
    """{title: cells} of a passing case's dropout, for the session's "passing" lines: how its masks were judged
    (replay, replica), where they were drawn (layer, residual or twice body, decoder), with activation
    checkpointing or grad accumulation around them."""
    how = mode(case)
    if not how:
        return {}
    where = []
    if case.model.factory == "decoder":
        where.append("decoder")
    else:
        where += ["layer" for layer in case.model.layers if layer.kind == "dropout" and layer.p > 0]
        where += [f"{layer.kind} body" for layer in case.model.layers
                  if layer.kind in ("residual", "twice") and any(c.kind == "dropout" and c.p > 0 for c in layer.children)]
    opts = case.target_options
    # (pp's microbatches are its schedule's n_microbatches)
    mbs = max(opts.get("microbatches", 1), opts.get("n_microbatches", 1))
    around = (["checkpointed"] if opts.get("ac") else []) + (["microbatches"] if mbs > 1 else [])
    return {"dropout": {how: 1, **{w: 1 for w in set(where)}, **{a: 1 for a in around}}}


def compares_loss_and_grads(case: Case) -> bool:
    """False where the case's masks are not the reference's by design ("replica"): its loss and grads."""
    return mode(case) != "replica"
