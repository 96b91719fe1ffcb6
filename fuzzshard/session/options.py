"""What a session draws and how long it searches: two typed, frozen records, from the command line down.

The CLI turns its arguments into them once (cli/common.py ``draws``, cli/fuzz.py, cli/soak.py); the
session (engine.py), a soak's cells (soak.py SoakOptions, as JSON), bench and the tests take them whole,
as a pool takes its PoolOptions (pool/options.py):
  - ``Draws``: what the strategies draw: targets, world sizes, the device, and the opt-in families
    (--ac, --dropout, --ao, --compile, --loop, ...); ``strategy_kwargs()`` is what ``fst.cases`` is
    given, the keywords at their default left out (so the draws stay as they were);
  - ``SessionOptions``: the session's bounds and places: --max-examples or --duration, the seed, the
    shrink budget, the findings folder, the example database, the plugins each finding records.

A draw flag shared by fuzz and soak is said once, here: its field, and beside it (``flag``) the flag's
spelling, help and argparse keywords, from which cli/common.py builds both parsers. A plain on/off one
(--ac) is then read without a word in cli/: adding one is this file and the strategy that draws it.
Nothing here imports torch or argparse.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


def flag(value, name: str, help: str, parsed: bool = False, **argparse) -> dataclasses.Field:
    """A draw field (default ``value``) that is a flag of fuzz and soak: ``name`` (--ac), its help and argparse
    keywords; ``parsed``: the CLI reads its text into the field, else it is an opt-in, off by default
    (``action="store_true"``) read as it is."""
    kwargs = {"help": help, **(argparse if parsed else {"action": "store_true", **argparse})}
    return field(default=value, metadata={"flag": name, "parsed": parsed, "argparse": kwargs})


MODELS_HELP = ("model families to draw, comma-separated: topologies (random trees of Linear, Embedding, "
               "LayerNorm, Conv1d; the default), decoder (a Llama-style transformer: SDPA attention with "
               "rotary embeddings and grouped-query heads, SwiGLU or GELU MLP, RMSNorm or LayerNorm, tied "
               "head or not, cross-entropy on token targets; fsdp2 draws torchtitan-style TP plans for it), "
               "moe (every case of the other families named, topologies where none is, with a "
               "torchtitan-style mixture-of-experts layer: routing, experts, load balancing; without it "
               "one topology or decoder in 8 has one, none on dtensor, whose MoE runs on full copies)")


@dataclass(frozen=True)
class Draws:
    """What a session draws (the module's docstring). The fields with a ``flag`` are fuzz's and soak's
    draw flags, in their --help order; a flag whose text the CLI reads into its field (--world-sizes,
    --optimizers, --models, --loop, --checkpoints) says ``parsed=True``."""
    targets: tuple[str, ...] = ("dtensor",)
    world_sizes: tuple[int, ...] = flag((1, 2, 3, 4), "--world-sizes", "comma-separated world sizes to draw "
                                        "from (default 1,2,3,4)", default=None, parsed=True)
    optimizer_names: tuple[str, ...] | None = flag(
        None, "--optimizers", "restrict to these torch.optim classes, comma-separated", default=None, parsed=True)
    models: tuple[str, ...] | None = flag(None, "--models", MODELS_HELP, default=None, metavar="FAMILIES",
                                          parsed=True)
    compile: bool = flag(False, "--compile",
                         "fsdp2 also draws torch.compile (inductor) of each block, before or after fully_shard as "
                         "torchtitan does, and of the optimizer step; the reference stays eager. Off by default: a "
                         "compile costs seconds a case")
    ac: bool = flag(False, "--ac",
                    "also draws activation checkpointing on every target that takes it (a quarter of the cases): "
                    "torch.utils.checkpoint reentrant or not, checkpoint_wrapper, apply_activation_checkpointing, "
                    "the composable checkpoint, torchtitan's per-op selective AC, per module or every k-th block; "
                    "the reference trains without it")
    ao: bool = flag(False, "--ao",
                    "fsdp2 also draws torchao's float8 training (convert_to_float8_training: the tensorwise, "
                    "rowwise and rowwise_with_gw_hp recipes over drawn Linears, the float8 all-gather, its "
                    "precomputed scales; emulated on CPU) and torchao's low-bit AdamW (AdamW8bit, AdamW4bit, "
                    "AdamWFp8, stepped eagerly); tp draws float8 under torchao's float8 TP styles. "
                    "Needs pip install 'fuzzshard[ao]': without torchao "
                    "these draws are off (one line says so)")
    loop: tuple[str, ...] = flag(
        (), "--loop", "the training loop drawn around the step, where the target takes it, comma-separated: "
        "clip (clip_grad_norm_ in every norm type, torchtitan's get_total_norm + "
        "clip_grads_with_norm_, clip_grad_value_, FSDP1's own), lr_scheduler (torch.optim.lr_scheduler, "
        "stepped every step and checkpointed), scaler (GradScaler / ShardedGradScaler with steps that "
        "overflow on purpose), async_save (dcp.async_save while training goes on); all (the "
        "default) or none. Each shrinks to not used", default="all", metavar="FEATURES", parsed=True)
    dropout: bool = flag(False, "--dropout",
                         "also draw dropout (nn.Dropout layers, the decoder's attention and residual dropout) in one "
                         "case in 3, where the target takes it; each rank's masks are seeded per step and the "
                         "reference replays them, or loss and grads go uncompared where torch promises no mask "
                         "(docs/oracles.md, Dropout). Off by default: the draws stay as they were")
    # None: a save/load round trip in some cases; True: every case; False: none
    checkpoint: bool | None = flag(
        None, "--checkpoints", "save mid-schedule and resume from a fresh model (full state dict, broadcast from "
        "rank 0, or DCP files, at any of the world sizes) in some cases (default), every case, or none",
        choices=["some", "all", "none"], default="some", parsed=True)
    device: str = "cpu"  # (the pool's: cli/common.py draws)
    mesh_dims: int = 2  # meshes of up to this many dims (a simulated session's: 3, simulate.py)
    dims_up_to_world: bool = False  # a topology's dims up to the world size (a simulated session's)

    def __post_init__(self):  # lists (JSON, a caller's) read as tuples: the record stays hashable and frozen
        for name in ("targets", "world_sizes", "optimizer_names", "models", "loop"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    def strategy_kwargs(self) -> dict:
        """The keywords ``fst.cases`` takes beside ``target``, ``world_sizes`` and ``device``: those not at
        their default (a session that names none draws what ``fst.cases()`` draws)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("targets", "world_sizes", "device") or getattr(self, f.name) == f.default:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if f.name in ("optimizer_names", "models") else value
        return out

    def to_json(self) -> dict:
        """Plain JSON; ``Draws(**it)`` is the same draws (a soak's cell process reads them so)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    def replace(self, **changes) -> Draws:
        return dataclasses.replace(self, **changes)


def flags() -> list[dataclasses.Field]:
    """The draw fields that are flags, in --help order."""
    return [f for f in dataclasses.fields(Draws) if "flag" in f.metadata]


@dataclass(frozen=True)
class SessionOptions:
    """How a session searches and where its files go (the module's docstring)."""
    out: str = "fuzzshard-out"
    max_examples: int | None = 100  # valid cases per target, where no duration bounds the session
    duration: float | None = None  # seconds: the search's bound (engine.py says what may run past it)
    seed: int = 0
    shrink_budget: float | None = None  # seconds; None: default_shrink_budget(duration)
    hypothesis_shrink: float | None = None  # seconds of a round's shrink budget Hypothesis may take; None: a third
    findings_dir: str | None = None  # None: ``out``
    database: object = None  # a path or redis URL (database.py), or an ExampleDatabase; None: OUT/.hypothesis
    plugins: tuple[str, ...] = ()  # --plugin files: each finding records them, so replay loads them
    pack: int | None = None  # cases drawn together and run side by side; None: as many as the pool holds

    def __post_init__(self):
        object.__setattr__(self, "out", str(self.out))
        object.__setattr__(self, "plugins", tuple(str(os.path.realpath(p)) for p in self.plugins))
        if self.findings_dir is not None:
            object.__setattr__(self, "findings_dir", str(self.findings_dir))

    def budget(self) -> float:
        """The shrink budget: as given, else ``default_shrink_budget``."""
        return default_shrink_budget(self.duration) if self.shrink_budget is None else self.shrink_budget

    def hypothesis_bound(self) -> float:
        """How long a round that found something goes on searching and shrinking (Hypothesis) before it ends."""
        return hypothesis_shrink_bound(self.budget()) if self.hypothesis_shrink is None else self.hypothesis_shrink


# A round that found something goes on searching and shrinking (Hypothesis) for this fraction of the shrink
# budget at most, then ends, and the reducer (reduce.py) has the whole budget for the round's findings: its edits
# take big steps (a whole feature, the ranks) where Hypothesis's later passes polish widths and seeds, and a
# shrink left to run for the whole budget (a busy machine, slow cases) left the reducer nothing (issue 45)
HYPOTHESIS_SHRINK_FRACTION = 1 / 3
HYPOTHESIS_SHRINK_ENV = "FUZZSHARD_HYPOTHESIS_SHRINK"  # seconds: the bound set outright (tests make it small)


def default_shrink_budget(duration: float | None) -> float:
    """A round that found something shrinks for a third of this at most
    (Hypothesis), then the reducer has this long to make its findings
    1-minimal: a quarter of the session (at least 30 s), never more than 5
    minutes (Hypothesis's own limit)."""
    return 300.0 if not duration else min(300.0, max(30.0, 0.25 * duration))


def hypothesis_shrink_bound(shrink_budget: float) -> float:
    """How long Hypothesis's shrink may take of a round's ``shrink_budget`` (HYPOTHESIS_SHRINK_FRACTION),
    the rest going to the reducer; $FUZZSHARD_HYPOTHESIS_SHRINK (seconds) sets it outright."""
    env = os.environ.get(HYPOTHESIS_SHRINK_ENV)
    if env:
        return min(float(env), shrink_budget)
    return HYPOTHESIS_SHRINK_FRACTION * shrink_budget
