"""Llama 3 model: torchtitan parameter names, flavor sizes, RoPE and causality.

Its initialisation is tested in test_model_init.py; the debug model both use (``debug_args``,
``debug_model``) is a fixture in conftest.py built from the constants here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from harness import MODEL_SEQ_LEN

from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer, model_args, num_params, rope_frequencies

LLAMA3_VOCAB = 128256


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
    assert a.max_seq_len == MODEL_SEQ_LEN
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
    assert debug_model.freqs_cis.shape == (MODEL_SEQ_LEN, hd // 2)


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
