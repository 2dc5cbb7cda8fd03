"""Llama 3 initialisation: deterministic and seeded, the right statistics, tiles that compose
into the full draw, and progress lines for large models.

The important promise: ``init_weights(seed)`` gives bit-identical full weights whatever mesh the
parameters are sharded over (FSDP on 3 or 4 ranks, HSDP 2 x 2, TP 2, FSDP 2 x TP 2), compared
with the draw rule written out plainly for whole tensors (``init_reference``), while each rank
draws only the tiles its shards overlap, not the full tensors. Other devices, threads and
expert parallelism are in ``test_init_device.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from harness import MODEL_SEED, MODEL_SEQ_LEN, run_by_world
from init_reference import reference_state

from trainer.build_model import PROGRESS_MIN_PARAMS, InitProgress
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer, model_args, num_params
from trainer.model.tiled_init import TILE, fill_local_, local_box, tile_shape

# --------------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------------


def full_state(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_init_is_deterministic_and_seed_dependent(debug_args: ModelArgs, debug_model: Transformer):
    again = Transformer(debug_args)
    torch.manual_seed(999)  # the global RNG must not matter
    again.init_weights(MODEL_SEED)
    a, b = full_state(debug_model), full_state(again)
    assert all(torch.equal(a[k], b[k]) for k in a)

    other = Transformer(debug_args)
    other.init_weights(MODEL_SEED + 1)
    c = full_state(other)
    for k in a:
        if k.endswith("norm.weight"):
            assert torch.equal(a[k], c[k])
        else:
            assert not torch.equal(a[k], c[k]), k

    # Every parameter has its own stream: same-shape parameters do not repeat each other.
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])
    assert not torch.equal(a["layers.0.attention.wk.weight"], a["layers.0.attention.wv.weight"])


def test_init_statistics(debug_model: Transformer, debug_args: ModelArgs):
    p = full_state(debug_model)
    for name, value in p.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
    assert p["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert p["tok_embeddings.weight"].mean().abs().item() < 0.02
    # Truncated at 3 std: the sample std is ~0.986 of the nominal one.
    assert p["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert p["layers.0.attention.wq.weight"].abs().max().item() <= 3 * 0.02 + 1e-6
    assert p["layers.0.feed_forward.w1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    out_std = debug_args.dim**-0.5
    assert p["output.weight"].std().item() == pytest.approx(out_std, rel=0.05)
    assert p["output.weight"].abs().max().item() <= 3 * out_std + 1e-6
    # Output projections of the blocks are depth-scaled: 0.02 / sqrt(2 (layer + 1)).
    for i in (0, debug_args.n_layers - 1):
        expected = 0.02 / math.sqrt(2 * (i + 1))
        for w in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
            assert p[f"layers.{i}.{w}.weight"].std().item() == pytest.approx(expected, rel=0.06), (i, w)


def test_init_on_meta_then_to_empty_matches_eager(debug_args: ModelArgs, debug_model: Transformer):
    """The trainer's path without sharding: meta -> to_empty -> init_weights (RoPE table too)."""
    with torch.device("meta"):
        model = Transformer(debug_args)
    model.to_empty(device="cpu")
    model.init_weights(MODEL_SEED)
    a, b = full_state(debug_model), full_state(model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(model.freqs_cis, debug_model.freqs_cis)
    assert "freqs_cis" in dict(model.named_buffers())


def test_tiles_compose_into_the_full_draw():
    """Any box drawn tile by tile equals that box of the whole tensor drawn at once: the
    property every mesh relies on, here over boxes that cut tiles anywhere."""
    shape = (3 * TILE[0] - 10, 2 * TILE[1] + 300)  # partial tiles at the far edges
    rng = random.Random(0)
    for kind in ("normal", "trunc_normal"):
        full = torch.empty(shape)
        fill_local_(full, shape, (0, 0), kind, 0.02, MODEL_SEED, "w")
        boxes = [((0, 0), (0, 5)), ((31, 1023), (2, 2)), ((TILE[0], TILE[1]), TILE)]
        for _ in range(30):
            r, c = rng.randrange(shape[0]), rng.randrange(shape[1])
            boxes.append(((r, c), (rng.randint(1, shape[0] - r), rng.randint(1, shape[1] - c))))
        for (r, c), (h, w) in boxes:
            local = torch.empty(h, w)
            fill_local_(local, shape, (r, c), kind, 0.02, MODEL_SEED, "w")
            assert torch.equal(local, full[r : r + h, c : c + w]), (kind, r, c, h, w)
        # A lower-precision parameter gets the float32 values rounded once.
        half = torch.empty(40, 50, dtype=torch.bfloat16)
        fill_local_(half, shape, (20, 1000), kind, 0.02, MODEL_SEED, "w")
        assert torch.equal(half, full[20:60, 1000:1050].to(torch.bfloat16))
    # Other names and seeds give other values.
    for seed, name in ((MODEL_SEED, "v"), (MODEL_SEED + 1, "w")):
        other = torch.empty(shape)
        fill_local_(other, shape, (0, 0), "trunc_normal", 0.02, seed, name)
        assert not torch.equal(other, full)
    assert tile_shape(1) == (TILE[1],) and tile_shape(3) == (1, *TILE)


def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("kind", ["normal", "trunc_normal"])
def test_tiled_draws_follow_the_distribution(kind: str):
    """The empirical CDF of a quarter of a million values is within 0.005 of the normal's, or
    of the normal's truncated at 3 std (an error in the inversion moves it far more)."""
    std, shape = 0.02, (8 * TILE[0], TILE[1])
    values = torch.empty(shape)
    fill_local_(values, shape, (0, 0), kind, std, MODEL_SEED, "w")
    x = torch.linspace(-3.5, 3.5, 141, dtype=torch.float64)
    sorted_values = values.flatten().double().sort().values
    empirical = torch.searchsorted(sorted_values, x * std, right=True).double() / values.numel()
    expected = normal_cdf(x)
    if kind == "trunc_normal":
        low, high = normal_cdf(torch.tensor(-3.0)), normal_cdf(torch.tensor(3.0))
        expected = ((expected - low) / (high - low)).clamp(0, 1)
        assert values.abs().max().item() <= 3 * std
    assert (empirical - expected).abs().max().item() < 0.005


def test_init_progress_lines(caplog: pytest.LogCaptureFixture):
    """A line per 10% of the parameters, or after 10 s without one, with the time so far."""
    now = [100.0]
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        fast = InitProgress(1000, clock=lambda: now[0])
        for _ in range(50):
            fast(20)  # 2% at a time, no time passing
        slow = InitProgress(1000, clock=lambda: now[0])
        for _ in range(10):
            now[0] += 4.0
            slow(5)  # 0.5% every 4 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:10] == [
        f"initialised {p}% of the parameters ({10 * p:,} of 1,000) in 0.0 s" for p in range(10, 101, 10)
    ]
    assert [line.split(" in ")[-1] for line in lines[10:]] == ["12.0 s", "24.0 s", "36.0 s"]
    # The debug model is too small to report progress; the real flavors are not.
    with torch.device("meta"):
        debug = Transformer(model_args("debugmodel", 2048, MODEL_SEQ_LEN))
        one_b = Transformer(replace(FLAVORS["1B"], max_seq_len=MODEL_SEQ_LEN))
    assert num_params(debug) < PROGRESS_MIN_PARAMS <= num_params(one_b)


# --------------------------------------------------------------------------------------------
# Mesh-independent initialisation (multi-process)
# --------------------------------------------------------------------------------------------

# A small model whose cuts fall inside tiles: under tp 2 x dp_shard 2 the rows of wq, wk, the
# embedding and the output are cut at 20, 40 or 50, w1 and w3 unevenly (1065 rows into 533 and
# 532), and w2's 2130 columns span three tiles cut by TP at 1065.
TP_ARGS = ModelArgs(
    dim=160,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=200,
    multiple_of=2,
    ffn_dim_multiplier=5.0,
    rope_scaling=False,
    max_seq_len=16,
)


@contextlib.contextmanager
def counting_draws() -> Iterator[list[int]]:
    """Count the values that ``Tensor.normal_`` and ``Tensor.uniform_`` fill: every random draw
    of the initialisation, whichever algorithm makes it (``nn.init`` fills through them too), and
    from whichever thread."""
    drawn, lock = [0], threading.Lock()
    originals = {name: getattr(torch.Tensor, name) for name in ("normal_", "uniform_")}

    def counted(method):
        def draw(self, *args, **kwargs):
            with lock:
                drawn[0] += self.numel()
            return method(self, *args, **kwargs)

        return draw

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(method))
    try:
        yield drawn
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def covering_tiles(global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """How many values the tiles overlapping a box hold: the box plus the tiling's slack."""
    if math.prod(shape) == 0:
        return 0
    total = 1
    for n, o, s, t in zip(global_shape, offset, shape, tile_shape(len(global_shape))):
        total *= min(n, -(-(o + s) // t) * t) - (o // t) * t
    return total


def sharded_init_worker(dp_replicate: int, dp_shard: int, tp: int, args: ModelArgs, seed: int) -> dict:
    """Build on meta, parallelise over the trainer's mesh as training does, materialise,
    initialise counting the random draws, and gather every parameter; every rank returns its
    draw counts and shard facts, rank 0 also the full weights."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import ParallelSettings, parallelize
    from trainer.runtime.distributed import init_distributed

    world_size = int(os.environ["WORLD_SIZE"])
    init_distributed("cpu", timeout_s=300)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, world_size=world_size)
    meshes = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, meshes, dims, ParallelSettings(seq_len=args.max_seq_len), "cpu")
    model.to_empty(device="cpu")
    with counting_draws() as drawn:
        model.init_weights(seed)
    state, local_shapes, placements = {}, {}, {}
    local_random = tiles = full_random = 0
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        local_shapes[name] = tuple(param.to_local().shape)
        placements[name] = tuple(
            "replicate" if p.is_replicate() else f"shard{p.dim}" if p.is_shard() else type(p).__name__
            for p in param.placements
        )
        if model.init_std(name)[0] != "ones":
            offset, shape = local_box(param)
            local_random += param.to_local().numel()
            tiles += covering_tiles(tuple(param.shape), offset, shape)
            full_random += param.numel()
        state[name] = param.full_tensor().detach().clone()
    out = {
        "local_shapes": local_shapes,
        "drawn": drawn[0],
        "local_random": local_random,
        "tiles": tiles,
        "full_random": full_random,
    }
    if dist.get_rank() == 0:
        out.update(
            state=state, freqs=model.freqs_cis.detach().clone(), placements=placements, mesh_ndim=meshes.fsdp.ndim
        )
    return out


def reference_init(args: ModelArgs) -> dict[str, torch.Tensor]:
    return reference_state(args, MODEL_SEED)


@pytest.fixture(scope="module")
def single_process_reference(debug_args: ModelArgs) -> dict[str, torch.Tensor]:
    return reference_init(debug_args)


@pytest.mark.parametrize("shape", ["debug", "tp"])
def test_one_process_is_the_reference(shape: str, debug_args: ModelArgs):
    """The unsharded model, which the meshes below are compared with through the reference."""
    args = debug_args if shape == "debug" else TP_ARGS
    model = Transformer(args)
    model.init_weights(MODEL_SEED)
    assert_matches_reference({"state": full_state(model), "freqs": model.freqs_cis}, reference_init(args))


def assert_matches_reference(got: dict, reference: dict) -> None:
    expected = reference["state"]
    assert got["state"].keys() == expected.keys()
    mismatched = [k for k in expected if not torch.equal(got["state"][k], expected[k])]
    assert mismatched == []
    assert torch.equal(got["freqs"], reference["freqs"])


def assert_draws_only_local_tiles(results: list[dict]) -> None:
    """Each rank drew its own values plus at most the slack of the tiles they touch, which is
    less than the full tensors (drawing the full tensors and slicing fails here)."""
    for rank, r in enumerate(results):
        assert r["local_random"] <= r["drawn"] <= r["tiles"], rank
        assert r["tiles"] < r["full_random"], rank


FSDP_INITS = {"FSDP-4": (4, 1, 4), "FSDP-3-uneven": (3, 1, 3), "HSDP-2x2": (4, 2, 2)}
TP_INITS = {"TP-2": (2, 1, 2), "FSDP-2xTP-2": (4, 2, 2)}


@pytest.fixture(scope="module")
def sharded_inits(debug_args: ModelArgs) -> dict[str, list[dict]]:
    """Every sharded initialisation of this file, one launch per world size."""
    cases = {
        name: (world, (sharded_init_worker, replicate, shard, 1, debug_args, MODEL_SEED))
        for name, (world, replicate, shard) in FSDP_INITS.items()
    }
    cases.update(
        {
            name: (world, (sharded_init_worker, 1, shard, tp, TP_ARGS, MODEL_SEED))
            for name, (world, shard, tp) in TP_INITS.items()
        }
    )
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FSDP_INITS))
def test_init_is_bitwise_mesh_independent(case, sharded_inits, single_process_reference):
    world_size, dp_replicate, dp_shard = FSDP_INITS[case]
    results = sharded_inits[case]
    got = results[0]
    assert_matches_reference(got, single_process_reference)
    assert_draws_only_local_tiles(results)

    # The mesh really sharded every parameter the way the case claims.
    expected = single_process_reference["state"]
    assert got["mesh_ndim"] == (2 if dp_replicate > 1 else 1)
    shard_placement = ("replicate", "shard0") if dp_replicate > 1 else ("shard0",)
    assert set(got["placements"].values()) == {shard_placement}
    for name, full in expected.items():
        rows = [r["local_shapes"][name][0] for r in results]
        chunks = [c.shape[0] for c in torch.chunk(full, dp_shard, dim=0)]
        chunks += [0] * (dp_shard - len(chunks))
        # Ranks are laid out (replicate, shard): rank r holds shard chunk r % dp_shard.
        assert rows == [chunks[r % dp_shard] for r in range(world_size)], name
    if world_size == 3:
        # The case is only meaningful if some shards are uneven.
        assert any(expected[k].shape[0] % 3 for k in expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TP_INITS))
def test_init_with_tensor_parallel_is_bitwise_mesh_independent(case, sharded_inits):
    """Column-wise (``Shard(0)``) and row-wise (``Shard(1)``) TP, the row-wise embedding, and
    FSDP over those TP DTensors (``_StridedShard``): each rank's box comes from its placements."""
    world_size, dp_shard, tp = TP_INITS[case]
    results = sharded_inits[case]
    got = results[0]
    assert_matches_reference(got, reference_init(TP_ARGS))
    assert_draws_only_local_tiles(results)

    # The layouts under test are the ones the case claims.
    w1, w2 = "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"
    hidden = TP_ARGS.ffn_hidden_dim
    assert got["placements"][w2][-1] == "shard1"  # row-wise TP
    assert [r["local_shapes"][w2][1] for r in results] == [hidden // tp] * world_size
    if dp_shard > 1:
        assert "_StridedShard" in got["placements"][w1]  # FSDP over column-wise TP
        rows = [r["local_shapes"][w1][0] for r in results]
        assert sorted(set(rows)) == [hidden // tp // 2, hidden // tp - hidden // tp // 2]  # uneven
    else:
        assert got["placements"][w1][-1] == "shard0"
