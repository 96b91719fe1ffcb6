"""pp's schedule catalog and stage arithmetic, and the objective a schedule step trains.

The schedules the installed torch has (``available``, simplest first), what
each one's constructor refuses (``REFUSALS``, ``accepts``), how many stages
a rank holds and which rank holds each (``stage_ranks``: torch's loop or
V-shaped placement), which top-level layers (the decoder's blocks) each
stage holds (``stage_layers``, from the drawn ``cuts``), and where a tied
weight's two uses land (``tie_span``). Then the objective a schedule step
trains, which the reference computes on the unsplit model (``pp_objective``).

Pure functions of a case's ``target_options`` and the world size: the draws,
the check, the facts, the adapter and the script writer (scriptgen/pp.py)
all read them here.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ....case import Case
from ...model import loss_fn, tie_uses


# the schedules, simplest first (shrinking goes there): name -> (stages per rank, style)
SCHEDULES = {
    "GPipe": ("single", "loop"),
    "1F1B": ("single", "loop"),
    "Interleaved1F1B": ("multi", "loop"),
    "LoopedBFS": ("multi", "loop"),
    "InterleavedZeroBubble": ("multi", "loop"),
    "ZBVZeroBubble": ("v", "v"),
    "DualPipeV": ("v", "v"),
}


# what torch says when it refuses a config by design (schedules.py, microbatch.py): such a case is invalid
REFUSALS = (
    "must be greater than or equal to the number of stages",  # Schedule1F1B
    "requires at least as many microbatches as stages",  # ScheduleDualPipeV
    "requires the number of microbatches to be a multiple of the number of rounds",  # Interleaved1F1B, ZB
    "is smaller than num_chunks",  # a batch of fewer samples than microbatches (_split_tensor)
)


def available() -> list[str]:
    """The schedules the installed torch has, in SCHEDULES' order."""
    import torch.distributed.pipelining as pipelining

    return [s for s in SCHEDULES if hasattr(pipelining, "Schedule" + s)]


def schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, "Schedule" + name)


def is_multi(name: str) -> bool:
    return SCHEDULES[name][0] != "single"


def accepts(name: str, n_microbatches: int, world: int, stages: int) -> bool:
    """Whether Schedule<name> takes this many microbatches (what its constructor checks)."""
    if name in ("1F1B", "DualPipeV"):
        return n_microbatches >= world * stages
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return n_microbatches % max(1, n_microbatches // world) == 0
    return True


def pp_degree(options: dict, world: int) -> int:
    """The pipeline's ranks: the world, over ``dp`` on a [pp, dp] mesh."""
    return world // options.get("dp", 1)


def n_stages(options: dict, world: int) -> int:
    return pp_degree(options, world) * options.get("stages", 1)


def stage_ranks(options: dict, world: int) -> list[int]:
    """The pp rank of each stage (torch's generate_stage_to_rank_mapping, loop or V style)."""
    n, pp = n_stages(options, world), pp_degree(options, world)
    if SCHEDULES[options["schedule"]][1] == "v":
        out, r = [], 0
        for s in range(n):
            out.append(r)
            if (s + 1) % pp:
                r += 1 if (s // pp) % 2 == 0 else -1
        return out
    return [s % pp for s in range(n)]


def stage_layers(options: dict, n_layers: int) -> list[list[int]]:
    """The top-level layer indices of each stage."""
    bounds = [0, *options["cuts"], n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stages_per_rank(name: str, world: int, n_layers: int) -> list[int]:
    """The stage counts per rank a schedule may take with this many top-level layers."""
    kind = SCHEDULES[name][0]
    if kind == "single":
        choices = [1]
    elif kind == "v":
        choices = [2]  # "ZBV requires exactly 2 stages per rank"
    else:
        choices = [2, 3]
    return [c for c in choices if world * c <= n_layers]


def n_units(model) -> int:
    """What the stages are cut from: a topology's top-level layers, the decoder's blocks."""
    return model.sizes["n_layers"] if model.factory == "decoder" else len(model.layers)


def uncuttable(model) -> str | None:
    """Why a model cannot be cut into stages, or None."""
    if model.factory == "decoder":
        return None
    if model.factory:
        return "pp cuts a topology's top-level layers or the decoder's blocks; a plugin's model has none to cut"
    return None


def tie_span(case: Case) -> str:
    """Where a tied weight's two uses (the embedding on the first stage, the head on the last) live: "" untied
    or one stage, "ranks" on two ranks (their grads all-reduced between them before the step, as Megatron-LM's
    embedding group does), "stages" on two stages of one rank (V schedules, or one pp rank: one param in both
    stage modules)."""
    if not tie_uses(case.model) or n_stages(case.target_options, case.world_size) < 2:
        return ""
    ranks = stage_ranks(case.target_options, case.world_size)
    return "ranks" if ranks[0] != ranks[-1] else "stages"


# the schedules that split a stage's backward into input and weight parts (stage_backward_input / _weight)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


# ---- what a schedule step trains: the reference's objective over the same microbatches ----

def microbatch_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The loss of each microbatch, split as the schedule splits the batch (tensor_split on dim 0)."""
    return [loss_fn(model(xm), ym) for xm, ym in zip(torch.tensor_split(x, n, 0), torch.tensor_split(y, n, 0))]


def combine(losses, options: dict) -> torch.Tensor:
    """The schedule's objective over its microbatch losses: their mean with scale_grads, else their sum."""
    total = sum(losses[1:], losses[0])
    return total / len(losses) if options.get("scale_grads") else total


def accumulate(steps, options: dict) -> torch.Tensor:
    """The objective of several schedule steps' microbatch losses (``accum``), whose grads add up in
    ``p.grad``: their sum, but with scale_grads each step ends by dividing the whole grad (the earlier steps'
    too: stage.scale_grads) by n_microbatches, so step a of A counts 1 / n_microbatches^(A - a)."""
    total = None
    for losses in steps:
        total = combine(losses, options) if total is None else combine([total + losses[0], *losses[1:]], options)
    return total


def pp_objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict) -> torch.Tensor:
    """The unsplit model on what the pipeline trains: each dp rank's equal slice of the batch, in ``accum``
    equal parts, each split into ``n_microbatches`` microbatches (``accumulate``); the mean over the dp
    slices (FSDP2's reduce-scatter averages)."""
    dp, n = options.get("dp", 1), options["n_microbatches"]
    per = []
    for xd, yd in zip(torch.tensor_split(x, dp, 0), torch.tensor_split(y, dp, 0)):
        parts = zip(torch.tensor_split(xd, options.get("accum", 1), 0), torch.tensor_split(yd, options.get("accum", 1), 0))
        per.append(accumulate([microbatch_losses(model, xa, ya, n) for xa, ya in parts], options))
    return per[0] if dp == 1 else sum(per[1:], per[0]) / dp


# ---- dropout: each stage's masks, drawn by its rank, replayed stage after stage (kernel/dropout.py) ----

# the schedules whose ranks draw their masks in an order the reference follows: one stage a rank (each rank's
# forwards: its stage on microbatch 0, 1, ... in order), and LoopedBFS (each rank's stages one after another,
# each over every microbatch in order); the interleaved, zero-bubble and V schedules interleave several stages'
# forwards on one rank's generator in the schedule's own order, which the reference does not follow
DROPOUT_SCHEDULES = ("GPipe", "1F1B", "LoopedBFS")


def schedule_dropout_problem(options: dict) -> str | None:
    """Why a pp case's dropout masks are not replayed under these options, or None."""
    if options.get("schedule") in DROPOUT_SCHEDULES:
        return None
    return (f"pp: dropout under Schedule{options.get('schedule')}: a rank's several stages draw their masks in "
            "the schedule's interleaved order, which the reference's replay does not follow (kernel/dropout.py)")


def dropout_index(pp_rank: int, dp_rank: int, dp: int) -> int:
    """The seed index a pipeline rank draws its masks from (kernel/dropout.py ``draw_from``): its row-major
    index on the [pp] or [pp, dp] mesh, so every stage rank and every dp rank draws its own."""
    return pp_rank * dp + dp_rank


def replayed_stages(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: dict, draws) -> torch.Tensor:
    """``pp_objective`` with the pipeline's dropout masks (``draws``: kernel/dropout.py's ``Draws``): the plain
    model cut into the pipeline's stages, for each dp slice the stages run one after another, each over every
    microbatch of every ``accum`` part in order, from its rank's generator: seeded as that rank's was
    (``dropout_index``), or where the rank ran a stage before (LoopedBFS), as that stage left it. The same math
    per microbatch as the whole model's (the stages compose to it), in the order each rank drew its masks."""
    from .stages import _StageModule, stage_ends

    dp, n, accum = options.get("dp", 1), options["n_microbatches"], options.get("accum", 1)
    total = len(options["cuts"]) + 1
    rank_of = stage_ranks(options, total // options.get("stages", 1) * dp)
    keyed = isinstance(model.layers, nn.ModuleDict)
    mods = [_StageModule({str(i): model.layers[str(i) if keyed else i] for i in layers},
                         getattr(model, "scale", None) if s == total - 1 else None, stage_ends(model, s, total - 1))
            for s, layers in enumerate(stage_layers(options, len(model.layers)))]
    per = []
    for d, (xd, yd) in enumerate(zip(torch.tensor_split(x, dp, 0), torch.tensor_split(y, dp, 0))):
        parts = list(zip(torch.tensor_split(xd, accum, 0), torch.tensor_split(yd, accum, 0)))
        hs = [list(torch.tensor_split(xa, n, 0)) for xa, _ in parts]
        states = {}
        for s, mod in enumerate(mods):
            r = rank_of[s]
            if r in states:
                draws.restore(states[r])
            else:
                draws.rank(dropout_index(r, d, dp))
            hs = [[mod(h) for h in hm] for hm in hs]
            states[r] = draws.state()
        steps = [[loss_fn(h, ym) for h, ym in zip(hm, torch.tensor_split(ya, n, 0))] for hm, (_, ya) in zip(hs, parts)]
        per.append(accumulate(steps, options))
    return per[0] if dp == 1 else sum(per[1:], per[0]) / dp
