"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

The keys and values of every head come from one ``kv_lora_rank``-wide latent per token (RMS-
normalised), which is what an inference cache keeps; queries from a ``q_lora_rank`` latent (or
straight from the hidden state when it is 0). Each head's query and key are a part without
position (``qk_nope_head_dim``) and a RoPE part (``qk_rope_head_dim``), the key's RoPE part one
vector shared by all heads and taken from the hidden state beside the latent; the value head
(``v_head_dim``) is sized apart from the query's. Names are torchtitan's (``wq_a``, ``q_norm``,
``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``); RoPE rotates adjacent channel pairs as
DeepSeek's own weights expect, so a Hugging Face folder needs no permutation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainer.model.rope import apply_rotary_emb


@dataclass(frozen=True)
class LatentShape:
    """The attention's widths (DeepSeek-V3's ``config.json`` names them the same, less ``_dim``)."""

    dim: int
    n_heads: int
    q_lora_rank: int
    """0: queries projected straight from the hidden state (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float = 1e-6
    softmax_scale: float = 1.0
    """A factor on the scores beyond ``1 / sqrt(qk_head_dim)``: YaRN's temperature squared."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentAttention(nn.Module):
    def __init__(self, shape: LatentShape, attention_fn: Callable[..., torch.Tensor]):
        """``attention_fn(q, k, v[, mask])`` over ``(batch, heads, seq, head_dim)``, causal: the
        block's, which context parallelism swaps as it swaps Llama's."""
        super().__init__()
        self.shape = shape
        self.attention_fn = attention_fn
        heads = shape.n_heads
        if shape.q_lora_rank:
            self.wq_a = nn.Linear(shape.dim, shape.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(shape.q_lora_rank, eps=shape.norm_eps)
            self.wq_b = nn.Linear(shape.q_lora_rank, heads * shape.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(shape.dim, heads * shape.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(shape.dim, shape.kv_lora_rank + shape.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(shape.kv_lora_rank, eps=shape.norm_eps)
        self.wkv_b = nn.Linear(shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * shape.v_head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: object = None) -> torch.Tensor:
        """``freqs_cis``: the RoPE table of the ``qk_rope_head_dim`` channels (``(seq, rope / 2)``)."""
        s = self.shape
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if s.q_lora_rank else self.wq(x)
        # -1 heads: under tensor parallelism each rank holds a slice of them.
        q = q.view(bsz, seqlen, -1, s.qk_head_dim)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), freqs_cis)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if s.softmax_scale != 1.0:
            q = q * s.softmax_scale
        if s.v_head_dim < s.qk_head_dim:
            # Flash kernels (CUDA's, and SDPA's on CPU) take one head width: zero value channels
            # give zero output channels, dropped below (as transformers pads for flash-attn).
            v = nn.functional.pad(v, (0, s.qk_head_dim - s.v_head_dim))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attention_fn(q, k, v) if mask is None else self.attention_fn(q, k, v, mask)
        out = out[..., : s.v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
