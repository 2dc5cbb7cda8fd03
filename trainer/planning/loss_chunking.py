"""Whether the output projection and loss run in chunks of tokens, and why.

Chunking (``trainer/loss.py``) keeps one chunk's logits alive instead of the micro-batch's, at
the price of recomputing each chunk's projection in backward and of smaller matmuls: on an H200
the 8B shape's step took 9% longer chunked (26,795 against 29,419 tokens/s, docs/performance.md),
while on the CPU it costs nothing measurable. So ``training.loss_chunk_tokens = -1`` (``auto``,
the default) chunks on a GPU only where the memory needs it: when the job, estimated with the
whole logits, would not fit in 90% of the memory limit the job is checked against (the estimate is
close, not exact: the rest is its margin, as for the presets, sized with 10% headroom). On the
CPU it always chunks: it costs nothing there, and the CPU's limit is the memory free when a rank
starts, which differs between ranks and between a run and its resume, so deciding by it would
let the same job round differently. A number the user sets is kept as set (0: whole logits, N:
chunks of N tokens). Exact MoE balancing under full checkpointing chunks too where its held
forwards fit, or where ``moe.held_forwards`` asks for them: they spare the counting pre-pass
(``Workload.holds_forwards``) and need the loss in chunks, whose gradients they compute at once
where the output weight is a plain tensor (``Workload.holds_loss_gradients``). Chunking changes the loss and gradients only by float32
round-off (``tests/test_loss.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.hardware import gib
from trainer.planning.memory_plan import estimate
from trainer.planning.workload import Workload

AUTO = -1
"""``training.loss_chunk_tokens``: chunk only where the whole logits would not fit."""
AUTO_CHUNK_TOKENS = 1024
"""The chunk ``auto`` picks: a chunk's logits are small beside a block's activations at any
vocabulary we train (128,256 x 1024 x 14 bytes = 1.8 GB), and its matmuls still fill a GPU."""
FIT_FRACTION = 0.9
"""Of the memory limit, what the job with the whole logits may take for ``auto`` not to chunk."""


@dataclass(frozen=True)
class LossChunking:
    tokens: int
    """Tokens per chunk; 0: the whole micro-batch's logits at once."""
    why: str

    def line(self) -> str:
        how = f"chunked, {self.tokens} tokens a chunk" if self.tokens else "unchunked (whole logits)"
        return f"{how}: {self.why}"


def resolve_loss_chunking(
    setting: int, workload: Workload, in_model: bool, limit: int | None, device: str
) -> LossChunking:
    """The chunking of ``training.loss_chunk_tokens`` = ``setting`` for a job of ``workload`` on
    ``device`` checked against ``limit`` bytes per rank (None: not known here, so chunked, the
    safe choice)."""
    if not in_model:
        return LossChunking(0, "tensor parallelism without loss parallel gathers the whole logits for the loss")
    if setting != AUTO:
        return LossChunking(setting, f"`training.loss_chunk_tokens` = {setting} as set")
    if device == "cpu":
        return LossChunking(AUTO_CHUNK_TOKENS, "auto, on the CPU (chunking costs nothing measurable there)")
    # Held forwards in their smallest form (each chunk's logits recomputed, in host memory where
    # `moe.held_forwards` lets the plan choose); where they are held is held_for_speed.fitted's to decide.
    offload = workload.offload_forwards or workload.fit_held_forwards
    chunked = replace(
        workload, loss_chunk_tokens=AUTO_CHUNK_TOKENS, hold_loss_gradients=False, offload_forwards=offload
    )
    if chunked.holds_forwards and not workload.fit_held_forwards:
        return LossChunking(
            AUTO_CHUNK_TOKENS,
            "auto: `moe.held_forwards` holds the step's forwards, which needs the loss in chunks (whole logits "
            "would be held for every micro-batch)",
        )
    if chunked.holds_forwards and (limit is None or estimate(chunked).total <= FIT_FRACTION * limit):
        return LossChunking(
            AUTO_CHUNK_TOKENS,
            "auto: exact MoE balancing counts the routing in the step's own forwards only with the loss in "
            "chunks (whole logits would be held for every micro-batch); the counting pre-pass this spares "
            "costs a forward. Without tensor parallelism each held forward computes its loss's gradients "
            "at once and keeps them (nothing recomputed in backward)",
        )
    whole = estimate(replace(workload, loss_chunk_tokens=0)).total
    if limit is None:
        return LossChunking(AUTO_CHUNK_TOKENS, "auto, and the memory limit is not known here")
    room = f"90% of the {gib(limit)} limit"
    if whole <= FIT_FRACTION * limit:
        return LossChunking(0, f"auto: with the whole logits the job needs {gib(whole)}, within {room}")
    return LossChunking(AUTO_CHUNK_TOKENS, f"auto: with the whole logits the job would need {gib(whole)}, over {room}")
