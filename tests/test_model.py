"""Llama 3 model: torchtitan parameter names, flavor sizes, RoPE, causality and initialisation.

The important promise is the last one: ``init_weights(seed)`` gives bit-identical full weights
whatever mesh the parameters are sharded over (FSDP on 3 or 4 ranks, HSDP 2 x 2, TP 2, FSDP 2 x
TP 2), compared with one process initialising an unsharded model, while each rank draws only
the tiles its shards overlap, not the full tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import run_by_world

from trainer.build import PROGRESS_MIN_PARAMS, InitProgress
from trainer.data.tokenizer import load_tokenizer
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer, model_args, num_params, rope_frequencies
from trainer.model.tiled_init import TILE, fill_local_, local_box, tile_shape

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = str(ROOT / "assets" / "tokenizer" / "shakespeare.model")
SEQ_LEN = 32
SEED = 1234
LLAMA3_VOCAB = 128256


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return load_tokenizer(TOKENIZER).vocab_size


@pytest.fixture(scope="module")
def debug_args(vocab_size: int) -> ModelArgs:
    return model_args("debugmodel", vocab_size, SEQ_LEN)


@pytest.fixture(scope="module")
def debug_model(debug_args: ModelArgs) -> Transformer:
    model = Transformer(debug_args)
    model.init_weights(SEED)
    return model


# --------------------------------------------------------------------------------------------
# Names and shapes
# --------------------------------------------------------------------------------------------


def expected_names(n_layers: int) -> set[str]:
    names = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(n_layers):
        names |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        names |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        names |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    return names


def test_parameter_names_are_torchtitans(debug_model: Transformer, debug_args: ModelArgs):
    names = [n for n, _ in debug_model.named_parameters()]
    assert len(names) == len(set(names))
    assert set(names) == expected_names(debug_args.n_layers)
    # The RoPE table is a buffer, not a parameter, and is not saved in checkpoints.
    assert "freqs_cis" not in debug_model.state_dict()
    assert set(debug_model.state_dict()) == expected_names(debug_args.n_layers)


def test_debugmodel_shapes_and_gqa(debug_model: Transformer, debug_args: ModelArgs, vocab_size: int):
    a = debug_args
    assert a.vocab_size == vocab_size  # the debug flavor takes the tokenizer's vocabulary
    assert a.max_seq_len == SEQ_LEN
    # Divisible by 4 so heads split evenly over up to 4 tensor-parallel ranks.
    assert a.n_heads % 4 == 0 and a.kv_heads % 4 == 0
    assert a.kv_heads < a.n_heads and a.n_heads % a.kv_heads == 0  # grouped-query attention
    p = dict(debug_model.named_parameters())
    hd = a.dim // a.n_heads
    assert p["tok_embeddings.weight"].shape == (vocab_size, a.dim)
    assert p["output.weight"].shape == (vocab_size, a.dim)
    assert p["norm.weight"].shape == (a.dim,)
    for i in range(a.n_layers):
        assert p[f"layers.{i}.attention.wq.weight"].shape == (a.n_heads * hd, a.dim)
        assert p[f"layers.{i}.attention.wk.weight"].shape == (a.kv_heads * hd, a.dim)
        assert p[f"layers.{i}.attention.wv.weight"].shape == (a.kv_heads * hd, a.dim)
        assert p[f"layers.{i}.attention.wo.weight"].shape == (a.dim, a.n_heads * hd)
        assert p[f"layers.{i}.feed_forward.w1.weight"].shape == (a.ffn_hidden_dim, a.dim)
        assert p[f"layers.{i}.feed_forward.w2.weight"].shape == (a.dim, a.ffn_hidden_dim)
        assert p[f"layers.{i}.feed_forward.w3.weight"].shape == (a.ffn_hidden_dim, a.dim)
    assert debug_model.freqs_cis.shape == (SEQ_LEN, hd // 2)


# --------------------------------------------------------------------------------------------
# Flavor sizes against the published Llama 3.x architectures
# --------------------------------------------------------------------------------------------

# flavor: (dim, layers, heads, kv heads, ffn hidden, published parameter count).
# 1B and 3B (Llama 3.2) are published with tied embeddings; meshtrain keeps a separate output
# projection (as torchtitan does), so their expected count adds vocab x dim.
PUBLISHED = {
    "1B": (2048, 16, 32, 8, 8192, 1_235_814_400 + LLAMA3_VOCAB * 2048),
    "3B": (3072, 28, 24, 8, 8192, 3_212_749_824 + LLAMA3_VOCAB * 3072),
    "8B": (4096, 32, 32, 8, 14336, 8_030_261_248),
    "70B": (8192, 80, 64, 8, 28672, 70_553_706_496),
    "405B": (16384, 126, 128, 8, 53248, 405_853_388_800),
}


def architecture_params(dim: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int) -> int:
    head_dim = dim // heads
    attention = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim
    ffn = 3 * dim * hidden
    return 2 * vocab * dim + layers * (attention + ffn + 2 * dim) + dim


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_sizes_match_published_llama3(flavor: str):
    dim, layers, heads, kv_heads, hidden, published = PUBLISHED[flavor]
    # Our own arithmetic reproduces the published numbers (sanity of the table above).
    assert architecture_params(dim, layers, heads, kv_heads, hidden, LLAMA3_VOCAB) == pytest.approx(published, rel=1e-3)

    args = model_args(flavor, 2048, 4096)  # a small tokenizer: real flavors keep 128256 rows
    assert args.vocab_size == LLAMA3_VOCAB
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (dim, layers, heads, kv_heads)
    assert args.ffn_hidden_dim == hidden
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward.w1.weight.shape == (hidden, dim)
    assert num_params(model) == pytest.approx(published, rel=0.01)
    assert num_params(model, exclude_embedding=True) == num_params(model) - LLAMA3_VOCAB * dim


def test_flavor_table_is_complete():
    assert set(FLAVORS) == {"debugmodel", *PUBLISHED}


def test_real_flavor_rejects_a_larger_tokenizer():
    with pytest.raises(ValueError, match="model.tokenizer_path"):
        model_args("8B", LLAMA3_VOCAB + 1, 128)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def reference_llama31_frequencies(head_dim: int, theta: float, scale_factor: float) -> list[float]:
    """Meta's published ``apply_scaling`` (llama3.1 reference code), written out in plain Python."""
    low_freq_factor, high_freq_factor, old_context_len = 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return out


def rotations(freqs: list[float], seq_len: int) -> torch.Tensor:
    f = torch.tensor(freqs, dtype=torch.float64)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), f)
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize(("flavor", "scale_factor"), [("8B", 8), ("70B", 8), ("1B", 32), ("3B", 32)])
def test_rope_llama31_scaling_matches_reference(flavor: str, scale_factor: int):
    seq_len = 4096
    args = replace(FLAVORS[flavor], max_seq_len=seq_len)
    assert args.rope_scaling
    table = rope_frequencies(args)
    assert table.shape == (seq_len, args.head_dim // 2)
    assert table.dtype == torch.complex64
    assert args.rope_scaling_factor == scale_factor  # Llama 3.1: 8; Llama 3.2: 32
    freqs = reference_llama31_frequencies(args.head_dim, args.rope_theta, scale_factor)
    plain = [args.rope_theta ** (-2 * i / args.head_dim) for i in range(args.head_dim // 2)]
    # The head dims and theta put frequencies in all three bands: kept, divided, blended.
    kept = sum(f == p for f, p in zip(freqs, plain))
    divided = sum(math.isclose(f, p / scale_factor, rel_tol=1e-12) for f, p in zip(freqs, plain))
    assert kept > 0 and divided > 0 and kept + divided < len(freqs)
    # Position 1's angle is the frequency itself.
    assert torch.allclose(table[1].angle().double(), torch.tensor(freqs, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.allclose(table, rotations(freqs, seq_len).to(torch.complex64), atol=2e-5, rtol=0)
    assert torch.allclose(table.abs(), torch.ones(table.shape), atol=1e-6)


def test_rope_without_scaling_is_plain_theta_powers(debug_args: ModelArgs):
    assert not debug_args.rope_scaling
    args = replace(debug_args, max_seq_len=512)
    table = rope_frequencies(args)
    d = args.head_dim
    plain = [args.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    assert torch.allclose(table[1].angle().double(), torch.tensor(plain, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.allclose(table, rotations(plain, 512).to(torch.complex64), atol=2e-5, rtol=0)
    assert torch.equal(table[0], torch.ones(d // 2, dtype=torch.complex64))
    # The same shape with scaling switched on differs (the low frequencies are slowed).
    assert not torch.allclose(rope_frequencies(replace(args, rope_scaling=True)), table)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def test_forward_shape_and_causality(debug_model: Transformer, debug_args: ModelArgs):
    gen = torch.Generator().manual_seed(0)
    b, s = 2, 16
    tokens = torch.randint(0, debug_args.vocab_size, (b, s), generator=gen)
    with torch.no_grad():
        logits = debug_model(tokens)
        assert logits.shape == (b, s, debug_args.vocab_size)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        for t in (s - 1, 7):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % debug_args.vocab_size
            other = debug_model(changed)
            # Earlier positions cannot see the change...
            torch.testing.assert_close(other[:, :t], logits[:, :t], rtol=1e-5, atol=1e-5)
            # ...the changed position and later ones do.
            assert not torch.allclose(other[:, t:], logits[:, t:])
        # Sequences shorter than max_seq_len use a prefix of the RoPE table.
        short = debug_model(tokens[:, :5])
        torch.testing.assert_close(short, logits[:, :5], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------------


def full_state(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_init_is_deterministic_and_seed_dependent(debug_args: ModelArgs, debug_model: Transformer):
    again = Transformer(debug_args)
    torch.manual_seed(999)  # the global RNG must not matter
    again.init_weights(SEED)
    a, b = full_state(debug_model), full_state(again)
    assert all(torch.equal(a[k], b[k]) for k in a)

    other = Transformer(debug_args)
    other.init_weights(SEED + 1)
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
    model.init_weights(SEED)
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
        fill_local_(full, shape, (0, 0), kind, 0.02, SEED, "w")
        boxes = [((0, 0), (0, 5)), ((31, 1023), (2, 2)), ((TILE[0], TILE[1]), TILE)]
        for _ in range(30):
            r, c = rng.randrange(shape[0]), rng.randrange(shape[1])
            boxes.append(((r, c), (rng.randint(1, shape[0] - r), rng.randint(1, shape[1] - c))))
        for (r, c), (h, w) in boxes:
            local = torch.empty(h, w)
            fill_local_(local, shape, (r, c), kind, 0.02, SEED, "w")
            assert torch.equal(local, full[r : r + h, c : c + w]), (kind, r, c, h, w)
        # A lower-precision parameter gets the float32 values rounded once.
        half = torch.empty(40, 50, dtype=torch.bfloat16)
        fill_local_(half, shape, (20, 1000), kind, 0.02, SEED, "w")
        assert torch.equal(half, full[20:60, 1000:1050].to(torch.bfloat16))
    # Other names and seeds give other values.
    for seed, name in ((SEED, "v"), (SEED + 1, "w")):
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
    fill_local_(values, shape, (0, 0), kind, std, SEED, "w")
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
        debug = Transformer(model_args("debugmodel", 2048, SEQ_LEN))
        one_b = Transformer(replace(FLAVORS["1B"], max_seq_len=SEQ_LEN))
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
    of the initialisation, whichever algorithm makes it (``nn.init`` fills through them too)."""
    drawn = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("normal_", "uniform_")}

    def counted(method):
        def draw(self, *args, **kwargs):
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
    model = Transformer(args)
    model.init_weights(SEED)
    return {"state": full_state(model), "freqs": model.freqs_cis.clone()}


@pytest.fixture(scope="module")
def single_process_reference(debug_args: ModelArgs) -> dict[str, torch.Tensor]:
    return reference_init(debug_args)


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
        name: (world, (sharded_init_worker, replicate, shard, 1, debug_args, SEED))
        for name, (world, replicate, shard) in FSDP_INITS.items()
    }
    cases.update(
        {
            name: (world, (sharded_init_worker, 1, shard, tp, TP_ARGS, SEED))
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
