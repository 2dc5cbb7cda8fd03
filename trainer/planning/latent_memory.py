"""The memory of a latent attention (DeepSeek-V3's, ``trainer/model/mla.py``), for the per-rank
estimate (``memory_plan.py``).

What differs from grouped-query attention, per block:

* **parameters**: the down-projections to the query latent (absent with ``q_rank`` 0, the
  queries then projected straight from the input) and to the key/value latent with the shared
  RoPE key, their norms, the heads' up-projections from the latents, and the output projection
  from the value heads;
* **activations**, per token: the latents and their normalised copies, which tensor parallelism
  replicates (every rank computes them on the gathered sequence); the heads' up-projections; q
  and k put together from their parts (every head's k, the RoPE part expanded over the heads);
  q scaled by YaRN's temperature; v padded to the query head's width for the flash kernels; the
  attention output and its value channels reshaped; RoPE's float32 copies of each query head's
  RoPE part and of the one shared key.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.model.deepseek_v3 import DeepSeekV3Args
from trainer.model.llama3 import ModelArgs


@dataclass(frozen=True)
class Latents:
    """A latent attention's widths."""

    q_rank: int
    """0: queries projected straight from the input."""
    kv_rank: int
    qk_head: int
    """A query or key head: the part without position and the RoPE part."""
    rope_head: int
    v_head: int

    def width(self, n_heads: int) -> int:
        """Every query head's (and, expanded, every key head's) width."""
        return n_heads * self.qk_head

    def params(self, dim: int, n_heads: int) -> int:
        q = self.width(n_heads)
        queries = dim * self.q_rank + self.q_rank + self.q_rank * q if self.q_rank else dim * q
        heads = n_heads * (self.qk_head - self.rope_head + self.v_head)
        keys_values = dim * (self.kv_rank + self.rope_head) + self.kv_rank + self.kv_rank * heads
        return queries + keys_values + n_heads * self.v_head * dim

    def kept(self, n_heads: int, tp: int) -> float:
        """Per token, the widths kept for backward as if TP split them all (the module docstring)."""
        q = self.width(n_heads)
        latent = 2 * self.q_rank + 2 * self.kv_rank + self.rope_head
        up = q + n_heads * (self.qk_head - self.rope_head + self.v_head)
        return latent * tp + up + 5 * q + n_heads * self.v_head

    def rope_width(self, n_heads: int) -> int:
        return (n_heads + 1) * self.rope_head


def latents_of(args: ModelArgs) -> Latents | None:
    """The latent attention of ``args``'s blocks; None for grouped-query attention."""
    if not isinstance(args, DeepSeekV3Args):
        return None
    shape = args.latent
    return Latents(shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim, shape.qk_rope_head_dim, shape.v_head_dim)
