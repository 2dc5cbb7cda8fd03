"""Qwen3 dense: Llama 3's block with RMSNorm on each query and key head, heads of 128 channels
apart from the width, RoPE without scaling (theta 1e6), and the output tied to the embedding in
the three smallest sizes.

The module is ``llama3.Transformer``; a flavor here is only its shape. The sizes are those of
the published ``config.json`` of Qwen/Qwen3-0.6B to Qwen3-32B (base and instruct share them):
the feed-forward width is given, not derived.
"""

from __future__ import annotations

from dataclasses import replace

from trainer.model.llama3 import ModelArgs

_QWEN3 = ModelArgs(
    vocab_size=151936,
    head_size=128,
    qk_norm=True,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling=False,
    n_kv_heads=8,
)


def _sized(dim: int, n_layers: int, n_heads: int, ffn: int, tie: bool) -> ModelArgs:
    return replace(_QWEN3, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_hidden_size=ffn, tie_embeddings=tie)


FLAVORS: dict[str, ModelArgs] = {
    # The debug model's size as a Qwen3 (q/k norms, heads apart from the width, tied output), so
    # that a run on this machine exports to a Qwen3ForCausalLM (train_configs/tiny_qwen3.toml).
    "qwen3_debug": replace(
        _QWEN3,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_size=64,
        ffn_hidden_size=768,
        vocab_size=2048,
        vocab_from_tokenizer=True,
        tie_embeddings=True,
    ),
    "0.6B": _sized(1024, 28, 16, 3072, tie=True),
    "1.7B": _sized(2048, 28, 16, 6144, tie=True),
    "4B": _sized(2560, 36, 32, 9728, tie=True),
    "8B": _sized(4096, 36, 32, 12288, tie=False),
    "14B": _sized(5120, 40, 40, 17408, tie=False),
    "32B": _sized(5120, 64, 64, 25600, tie=False),
}
