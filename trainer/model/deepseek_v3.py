"""DeepSeek-V3's shape: our MoE's blocks with multi-head latent attention (``mla.py``), YaRN on
the RoPE channels, sigmoid routing limited to the best groups of experts with a routed scaling
factor and the aux-loss-free bias, shared experts and dense first blocks of their own width.

A flavor here is only the shape; the blocks are ``llama3.TransformerBlock`` with a
``LatentAttention`` and the MoE's feed-forward (or the dense SwiGLU of ``ffn_hidden_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.model import rope
from trainer.model.llama3 import TransformerBlock, causal_attention
from trainer.model.mla import LatentAttention, LatentShape
from trainer.model.moe import MoE, MoEArgs


@dataclass(frozen=True)
class DeepSeekV3Args(MoEArgs):
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    yarn_factor: float = 1.0
    """YaRN's context factor (1: plain RoPE); DeepSeek-V3 publishes 40 over 4096 tokens."""
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0

    @property
    def latent(self) -> LatentShape:
        temperature = rope.yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim)
        return LatentShape(
            dim=self.dim,
            n_heads=self.n_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            norm_eps=self.norm_eps,
            softmax_scale=temperature**2,
        )

    @property
    def attention_width(self) -> float:
        return self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2

    def make_block(self, layer_id: int) -> nn.Module:
        feed_forward = None if layer_id < self.n_dense_layers else MoE(self)
        return TransformerBlock(layer_id, self, feed_forward, LatentAttention(self.latent, causal_attention))

    def rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        if self.yarn_factor <= 1:
            return rope.frequencies(self.qk_rope_head_dim, self.rope_theta, self.max_seq_len, device=device)
        magnitude = rope.yarn_mscale(self.yarn_factor, self.yarn_mscale) / rope.yarn_mscale(
            self.yarn_factor, self.yarn_mscale_all_dim
        )
        return rope.yarn_frequencies(
            self.qk_rope_head_dim,
            self.rope_theta,
            self.max_seq_len,
            self.yarn_factor,
            self.yarn_original_context,
            self.yarn_beta_fast,
            self.yarn_beta_slow,
            magnitude,
            device,
        )


FLAVORS: dict[str, DeepSeekV3Args] = {
    # Every part at the debug model's size (a query latent, YaRN, a dense first block, group-
    # limited sigmoid routing, a shared expert, a value head narrower than the query's), so that
    # a run on this machine exports to a DeepseekV3ForCausalLM (train_configs/tiny_deepseek_v3.toml).
    "deepseek_v3_debug": DeepSeekV3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        vocab_size=2048,
        vocab_from_tokenizer=True,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=False,
        ffn_hidden_size=768,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        n_shared_experts=1,
        n_dense_layers=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        n_groups=4,
        topk_groups=2,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        yarn_factor=4.0,
        yarn_original_context=32,
    ),
    # Hugging Face's moonshotai/Moonlight-16B-A3B config.json: DeepSeek-V3's architecture at
    # DeepSeek-V2-Lite's size (no query latent, 64 experts in one group, 2 shared).
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=False,
        ffn_hidden_size=11264,
        n_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        n_shared_experts=2,
        n_dense_layers=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.446,
        q_lora_rank=0,
    ),
    # Hugging Face's deepseek-ai/DeepSeek-V3 config.json.
    "671B": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=False,
        ffn_hidden_size=18432,
        n_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        n_groups=8,
        topk_groups=4,
        yarn_factor=40.0,
    ),
}
