"""torchao's low-bit AdamW on fsdp2 (fuzzshard/kernel/lowbit.py): skipped where torchao is not installed."""
import dataclasses

import pytest

pytest.importorskip("torchao", reason="torchao is not installed (pip install 'fuzzshard[ao]'): its draws are off")


def _lowbit_case(name: str, world: int = 2, short: int = 0, **options):
    from cases import simple_case
    from fuzzshard.case import Group, Layer, Model, Optim
    from fuzzshard.kernel.lowbit import LOWBIT_OPTIMIZERS, lowbit_model

    model = lowbit_model(Model("features", 5, (Layer("linear", 5, 3),)), world, LOWBIT_OPTIMIZERS[name], short)
    groups = (Group(("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")),
              Group(("layers.3.weight", "layers.3.bias"), {"lr": 0.02}))
    return dataclasses.replace(simple_case(world, optim="Adam"), target="fsdp2", batch=2 * world, model=model,
                               optim=Optim(name, {"lr": 0.01, "weight_decay": 0.1}), groups=groups,
                               target_options={"wrap": [], "reshard_after_forward": True, **options})


def test_the_lowbit_draw_widens_the_model_so_that_shards_get_quantized_state():
    from hypothesis import HealthCheck, given, seed, settings

    import fuzzshard.strategies as fst
    from fuzzshard.kernel.lowbit import LOWBIT_MIN, LOWBIT_OPTIMIZERS
    from fuzzshard.kernel.model import param_shapes

    seen = []

    @seed(0)
    @settings(max_examples=12, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fst.cases(target="fsdp2", world_sizes=[1, 2, 3], ao=True, checkpoint=False))
    def draws(case):
        if case.optim.name not in LOWBIT_OPTIMIZERS:
            return
        seen.append(case.optim.name)
        shards, block = case.mesh_shape[-1], LOWBIT_OPTIMIZERS[case.optim.name]
        rows = [s[0] for s in param_shapes(case.model).values() if len(s) == 2]
        wide = [r for r, s in zip(rows, [s for s in param_shapes(case.model).values() if len(s) == 2])
                if -(-r // shards) * s[1] >= LOWBIT_MIN]
        assert wide, param_shapes(case.model)
        # each rank's shard of the widest weight: whole blocks, or the last one a row short
        r, d = max((s for s in param_shapes(case.model).values() if len(s) == 2), key=lambda s: s[0] * s[1])
        assert (-(-r // shards) * d) % block == 0 and r % shards in (0, shards - 1)
        assert set(case.optim.kwargs) <= {"lr", "betas", "eps", "weight_decay", "amsgrad"}

    draws()
    assert seen, "no low-bit optimizer drawn in 12 cases"


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_the_bound_holds_torchaos_quantization_and_not_a_neighbour_blocks_scale(name):
    """One shard's moment quantized by torchao's own subclass: every element within lowbit_bound of the float32
    value (most of the bound unused: it is one code interval, rounding takes half); the same values quantized
    with each block's neighbour's scale break it."""
    import torch
    import torchao.optim as ao

    from fuzzshard.kernel.lowbit import LOWBIT_OPTIMIZERS, lowbit_bound

    block = LOWBIT_OPTIMIZERS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 0, 64).unsqueeze(1)  # blocks of many magnitudes
    for key, signed, v in (("exp_avg", True, x), ("exp_avg_sq", False, x.square())):
        state = getattr(ao, name)._subclass_zeros(v, signed, block)
        state.copy_(v)
        err = (state.dequantize().double() - v.double()).abs()
        bound = lowbit_bound(name, key, v, 1)
        # (plus the float32 rounding of code x scale, which the step's own tolerance holds in the oracle)
        assert (err <= bound + 2 ** -23 * v.abs()).all() and err.max() > 0, (key, (err - bound).max())
        # a neighbour block's scale: a value past it ends up within it (the code table spans [-1, 1]), so it
        # moves by at least its excess over that scale
        neighbour = v.reshape(-1, block).abs().amax(-1, keepdim=True).roll(1, 0)
        excess = (v.reshape(-1, block).abs() - neighbour).clamp(min=0).reshape(v.shape)
        assert (excess.double() > bound).any(), key


def test_the_bound_follows_the_shards_layout():
    """A shard with too few elements, or not a whole number of blocks, keeps float32 state: bound 0 there."""
    import torch

    from fuzzshard.kernel.lowbit import lowbit_bound, lowbit_rows

    rows = lowbit_rows(3, 2, 256)
    assert rows == 2 * 1536  # 1536 rows of 3 = 4608 elements a shard: 18 blocks
    x = torch.randn(rows - 1, 3)  # the last shard a row short: float32
    b = lowbit_bound("AdamW8bit", "exp_avg", x, 2)
    assert (b[:1536] > 0).all() and (b[1536:] == 0).all()
    assert (lowbit_bound("AdamW8bit", "exp_avg", torch.randn(rows, 3), 3) == 0).all()  # 1024 rows x 3: too few


def test_lowbit_fsdp2_is_in_parity_and_a_neighbour_blocks_scale_is_caught(tmp_path):
    """AdamW8bit on fully_shard's params, two steps: clean, in parity with the same class stepping float32 state
    within the derived bound; with rank 1 quantizing each block by its neighbour's scale, the moments of the wide
    weight it shards move past it at step 0."""
    from conftest import replay_clean_then_buggy

    buggy = replay_clean_then_buggy(tmp_path, _lowbit_case("AdamW8bit"), "ao_lowbit_neighbour_scale.py")
    assert "FAIL: fsdp2.parity.AdamW8bit" in buggy and "state.exp_avg of layers.1.weight after step 0" in buggy, buggy
    assert "one code interval" in buggy, buggy


def test_the_layout_rules_say_where_torchaos_checkpoint_bugs_show_and_the_cases_are_drawn():
    """fully_shard's dim-0 shards as torchao quantizes them, and the two checkpoint layouts torchao fails on
    (docs/ao/lowbit_full_state_dict_mixed.py, docs/ao/lowbit_dcp_reshard_unaligned.py): known torchao bugs now,
    not refused (nor float64 params)."""
    from fuzzshard.case import Checkpoint
    from fuzzshard.kernel.lowbit import lowbit_chunks, lowbit_cuts_blocks, lowbit_layout, lowbit_problem

    assert lowbit_chunks(3, 2) == [(0, 2), (2, 3)] and lowbit_chunks(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert lowbit_layout((3, 3072), 2, 256) == [True, False]  # 6144 and 3072 elements
    assert lowbit_layout((1024, 8), 2, 256) == [True, True]
    assert lowbit_cuts_blocks((1024, 8), 2, 3, 256)  # rows 342 | 342 | 340 cut the saved 512-row shards
    assert not lowbit_cuts_blocks((1024, 8), 2, 1, 256) and not lowbit_cuts_blocks((1024, 8), 2, 4, 256)
    case = _lowbit_case("AdamW8bit")  # its layers.3.weight (3, 3072): quantized on rank 0 only
    full = dataclasses.replace(case, checkpoint=Checkpoint(0, "full", 2, (2,), dict(case.target_options)))
    assert lowbit_problem(full, (2,), case.target_options) is None
    dcp = dataclasses.replace(case, checkpoint=Checkpoint(0, "dcp", 1, (1,), dict(case.target_options)))
    assert lowbit_problem(dcp, (2,), case.target_options) is None
    assert lowbit_problem(dataclasses.replace(case, dtype="float64"), (2,), case.target_options) is None
    # fuzzshard's own limit (its async-save staging check clones the live state): every low-bit optimizer's state
    # (the --ao hunt met AdamW8bit's OptimState8bit raising in that clone, which is fuzzshard's error, no finding)
    for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        c = _lowbit_case(name)
        staged = dataclasses.replace(c, checkpoint=Checkpoint(0, "dcp", 2, (2,), dict(c.target_options),
                                                              async_save="pinned"))
        assert "async save" in (lowbit_problem(staged, (2,), c.target_options) or ""), name


@pytest.mark.slow
def test_a_dcp_load_at_another_world_size_requantizes_within_the_bound(tmp_path, cli):
    """Saved over 2 ranks (layers.3.weight: rank 0's shard quantized, rank 1's float32), loaded over 1 (the whole
    weight quantized: rank 1's part requantized): the loaded state within one code interval of the loading side's
    blocks, and the run after it in parity."""
    from fuzzshard.case import Checkpoint, Step

    case = _lowbit_case("AdamW8bit")
    case = dataclasses.replace(case, checkpoint=Checkpoint(0, "dcp", 1, (1,), dict(case.target_options)),
                               schedule=(Step(), Step(), Step()), batch=4)
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    r = cli("replay", path)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_checkpoints_scale_shifted_by_a_block_is_caught_at_the_load(tmp_path, cli):
    """The low-bit state through a DCP round trip at another world size (saved over 2 ranks, loaded over 1): with
    the loaded scales one block off (planted in the quantized copy DCP's load makes), the checkpoint oracle names
    the loaded moments (the clean round trip: test_a_dcp_load_at_another_world_size_requantizes_within_the_bound)."""
    from fuzzshard.case import Checkpoint, Step

    case = _lowbit_case("AdamW8bit")
    case = dataclasses.replace(case, checkpoint=Checkpoint(0, "dcp", 1, (1,), dict(case.target_options)),
                               schedule=(Step(), Step(), Step()), batch=4)
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    r = cli("replay", path, setup="ao_lowbit_ckpt_scale_shift.py")
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "FAIL: fsdp2.checkpoint.dcp.loaded.state.exp_avg" in r.stdout, r.stdout
    assert "loaded.state.exp_avg of layers.1.weight (saved after step 0)" in r.stdout, r.stdout
