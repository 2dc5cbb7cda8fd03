"""Multi-head latent attention and YaRN against transformers' DeepSeek-V3 (an independent
reference): the same weights give the same attention output, and a wrong YaRN ramp, scale or
RoPE layout does not."""

from __future__ import annotations

import pytest
import torch

from trainer.model.llama3 import causal_attention
from trainer.model.mla import LatentAttention, LatentShape
from trainer.model.rope import yarn_frequencies, yarn_mscale

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

SEQ = 32
YARN = {"factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1}
OUT_TOL = 1e-5


def hf_attention(
    q_lora_rank: int | None, mscale_all_dim: float
) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding]:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": mscale_all_dim, **YARN}
    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=SEQ, rope_parameters=rope,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(
                1 + 0.3 * torch.randn(p.shape, generator=gen)
                if p.dim() == 1
                else 0.2 * torch.randn(p.shape, generator=gen)
            )
    return attention, DeepseekV3RotaryEmbedding(config)


def ours_of(hf: DeepseekV3Attention, mscale_all_dim: float) -> tuple[LatentAttention, torch.Tensor]:
    c = hf.config
    shape = LatentShape(
        dim=c.hidden_size, n_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        norm_eps=c.rms_norm_eps, softmax_scale=yarn_mscale(YARN["factor"], mscale_all_dim) ** 2,
    )  # fmt: skip
    ours = LatentAttention(shape, causal_attention)
    names = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}  # fmt: skip
    ours.load_state_dict({n: hf.state_dict()[f"{names[n.split('.')[0]]}.weight"] for n in ours.state_dict()})
    magnitude = yarn_mscale(YARN["factor"], 1.0) / yarn_mscale(YARN["factor"], mscale_all_dim)
    table = yarn_frequencies(
        c.qk_rope_head_dim, 10000.0, SEQ, YARN["factor"], YARN["original_max_position_embeddings"], magnitude=magnitude
    )
    return ours, table


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["query latent", "query projected straight"])
@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.8])
def test_latent_attention_is_deepseek_v3_s(q_lora_rank: int | None, mscale_all_dim: float) -> None:
    hf, rotary = hf_attention(q_lora_rank, mscale_all_dim)
    ours, table = ours_of(hf, mscale_all_dim)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ)[None].expand(2, -1)
    with torch.no_grad():
        theirs = hf(x, rotary(x, positions), None)[0]
        mine = ours(x, table)
    assert (mine - theirs).abs().max().item() < OUT_TOL * theirs.abs().max().item()


def test_the_comparison_sees_yarn_and_the_temperature() -> None:
    """Without YaRN's ramp (plain RoPE) or without its temperature the outputs part."""
    hf, rotary = hf_attention(24, 0.8)
    ours, table = ours_of(hf, 0.8)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ)[None].expand(2, -1)
    with torch.no_grad():
        theirs = hf(x, rotary(x, positions), None)[0]
        plain = yarn_frequencies(8, 10000.0, SEQ, 1.0, 8)
        assert (ours(x, plain) - theirs).abs().max() > 1e-3
        ours.shape = LatentShape(**{**ours.shape.__dict__, "softmax_scale": 1.0})
        assert (ours(x, table) - theirs).abs().max() > 1e-3
