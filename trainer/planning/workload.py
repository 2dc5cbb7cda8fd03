"""What the memory estimate (``memory_plan.py``) and the step's plan depend on: the job in the
trainer's own terms (the model's shape, the mesh, the batch, the settings that change what a rank
holds), and the shapes derived from it (a block's parameters, what FSDP gathers of it)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.planning.latent_memory import Latents
from trainer.planning.moe_memory import RoutedExperts


@dataclass(frozen=True)
class Workload:
    """What the estimate depends on, in the trainer's own terms."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_dim: int
    vocab_size: int
    local_batch_size: int
    """Sequences of one micro-batch the model runs: under pipeline parallelism, the pipeline's
    micro-batch (``parallelism.pipeline_parallel_microbatch_size``)."""
    seq_len: int
    dp_shard: int
    cp: int
    tp: int
    compute_bytes: int
    """Bytes per element of activations and gathered parameters (2 for bf16, 4 for fp32)."""
    reduce_bytes: int = 4
    """Bytes per element of gradients accumulated unsharded (``training.mixed_precision_reduce``)."""
    float8_all_gather: bool = False
    """FSDP gathers the blocks' linear weights in float8 (1 byte each; ``float8.enable_fsdp_float8_all_gather``).
    Float8 training keeps the same activations as bf16: torchao saves the high-precision inputs."""
    ac_mode: str = "none"
    ac_option: str = "op"
    loss_parallel: bool = True
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the output projection and loss; 0: the whole micro-batch's logits."""
    defer_gradient_reduction: bool = False
    accumulation: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation)."""
    fixed_global_batch: bool = True
    """``training.global_batch_size`` is set: more data-parallel ranks must divide it."""
    reshard_after_forward: str = "default"
    gathers_one_rank_experts: bool = False
    """Routed experts whose FSDP unit spans one rank stay gathered through the step
    (``fsdp_reshard_after_forward = default``, no HSDP, no layout-invariant mode)."""
    cp_allgather_kv: bool = True
    cp_ulysses: bool = False
    document_mask: bool = False
    tied_embeddings: bool = False
    """The output projection is the embedding's matrix: one table of parameters, not two."""
    device: str = "cpu"
    runtime_bytes: int | None = None
    """What the process holds whatever the model; None: the device's figure (``trainer/hardware.py``)."""
    cuda_build: bool = False
    """Whether torch is a CUDA build, whose libraries a CPU process holds too."""
    allocator_slack: float | None = None
    """As a fraction of the activations; None: the device's figure."""
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1
    """Pipeline micro-batches per schedule step on each data-parallel rank."""
    muon: bool = False
    """``optimizer.name = "Muon"``: one buffer for the blocks' matrices, and the whole matrices of the
    optimizer step's exchange (:func:`muon_exchange`)."""
    pp_layers_per_stage: int = -1
    pp_first_less: int = 1
    pp_last_less: int = 1
    head_dim: int = 0
    """Width of an attention head; 0: ``dim / n_heads`` (Qwen3's heads are wider)."""
    latents: Latents | None = None
    """A latent attention's (DeepSeek-V3: ``latent_memory.py``); None: grouped-query attention."""
    experts: RoutedExperts | None = None
    """A Mixture-of-Experts model's routed experts (``moe_memory.py``); None: dense."""
    hold_forwards: bool = True
    """Exact MoE balancing may hold the step's forwards (:attr:`holds_forwards`); False where
    ``held_for_speed.fitted`` found that they would not fit."""
    hold_loss_gradients: bool = True
    """Held forwards may keep their loss's gradients (:attr:`holds_loss_gradients`); False where
    ``held_for_speed.fitted`` found that they would not fit."""
    offload_forwards: bool = False
    """Held forwards wait in host memory (:attr:`offloads_forwards`)."""
    fit_held_forwards: bool = True
    """``moe.held_forwards = auto``: ``held_for_speed.fitted`` chooses where the forwards are held,
    else the setting has (``hold_forwards``, ``offload_forwards``)."""

    @property
    def holds_forwards(self) -> bool:
        """Whether exact (``global_batch``) balancing counts the step's routing in the step's own
        forwards, all run before the first backward (``trainer/step/expert_balance.py``), instead of
        a forward-only pre-pass: where a held forward keeps little, under full checkpointing
        (each block's input) with the loss computed in chunks (``training.loss_chunk_tokens``:
        at most one chunk's logits held per micro-batch; whole logits would be held otherwise,
        under tensor parallelism without loss parallel or with the chunking off), and without
        pipeline parallelism (whose schedules interleave forwards and backwards)."""
        exact = self.experts is not None and self.experts.exact_balance and self.hold_forwards
        return exact and self.ac_mode == "full" and self.pp == 1 and self.loss_chunk_tokens > 0

    @property
    def offloads_forwards(self) -> bool:
        """Whether the held forwards' saved tensors wait in host memory (``trainer/step/host_offload.py``):
        the device then holds two micro-batches' worth of them at most, the one in backward and
        the next, brought back while it runs."""
        return self.holds_forwards and self.offload_forwards

    @property
    def holds_loss_gradients(self) -> bool:
        """Whether a held forward computes its loss's gradients at once and keeps them (those of
        the final hidden states and of the output weight) instead of recomputing each chunk's
        logits in backward (``trainer/loss.py``): with the held forwards, without tensor
        parallelism (whose output weight is a DTensor)."""
        return self.holds_forwards and self.hold_loss_gradients and self.tp == 1

    @property
    def widths(self) -> tuple[int, int]:
        """The queries' and the keys' widths (a latent attention's keys: every head's)."""
        if self.latents is not None:
            return self.latents.width(self.n_heads), self.latents.width(self.n_heads)
        head_dim = self.head_dim or self.dim // self.n_heads
        return self.n_heads * head_dim, self.kv_heads * head_dim

    @property
    def attention_params(self) -> int:
        q, kv = self.widths
        return 2 * self.dim * (q + kv) if self.latents is None else self.latents.params(self.dim, self.n_heads)

    @property
    def attention_kept(self) -> float:
        """Per token, the widths of what one block's attention keeps for backward beside the
        all-gathered norm output, as if tensor parallelism split them all (``_activations``):
        q, repeated k and v, the attention output and its reshaped copy, k and v unrepeated;
        a latent attention's (``latent_memory.py``)."""
        q, kv = self.widths
        return 5 * q + kv if self.latents is None else self.latents.kept(self.n_heads, self.tp)

    @property
    def rope_width(self) -> int:
        """Per token, the channels RoPE rotates (in float32)."""
        return sum(self.widths) if self.latents is None else self.latents.rope_width(self.n_heads)

    @property
    def dense_block(self) -> int:
        return self.attention_params + 2 * self.dim + 3 * self.dim * self.ffn_dim

    @property
    def dense_layers(self) -> int:
        return self.n_layers if self.experts is None else min(self.experts.dense_layers, self.n_layers)

    @property
    def block_params(self) -> int:
        """Per block, on average (a Mixture-of-Experts model's dense first blocks are smaller)."""
        moe = 0
        if self.experts is not None:
            ffn = self.experts.feed_forward_params(self.dim) - 3 * self.dim * self.ffn_dim
            moe = (self.n_layers - self.dense_layers) * (self.dense_block + ffn)
        return (self.dense_layers * self.dense_block + moe) // self.n_layers

    @property
    def gathered_block(self) -> float:
        """The most parameters FSDP gathers for one block on one rank: TP's shard of the dense
        layers, but a MoE feed-forward whole (TP replicates its router and shared experts; its
        experts are split by EP, not TP), and under EP only the rank's own experts."""
        dense = self.dense_block / self.tp
        if self.experts is None or self.dense_layers == self.n_layers:
            return dense
        moe = dense - 3 * self.dim * self.ffn_dim / self.tp + self.experts.gathered_params(self.dim)
        return max(moe, dense if self.dense_layers else 0)

    def unsharded(self, blocks: int, first: bool, last: bool) -> float:
        """Parameters of ``blocks`` average blocks, with the embedding and the output, as one
        rank holds them unsharded (gathered, or their gradients before the reduction)."""
        moe = 0.0
        if self.experts is not None:
            whole = self.experts.gathered_params(self.dim) - 3 * self.dim * self.ffn_dim / self.tp
            moe = (self.n_layers - self.dense_layers) * whole
        per_block = (self.n_layers * self.dense_block / self.tp + moe) / self.n_layers
        return blocks * per_block + (self.tables(first, last) * self.vocab_size * self.dim + self.dim * last) / self.tp

    def tables(self, first: bool, last: bool) -> int:
        """Vocabulary-by-width matrices of a rank holding the first and/or the last stage."""
        return 1 if self.tied_embeddings and (first or last) else first + last

    @property
    def experts_stay_gathered(self) -> bool:
        """Expert parallelism over every data-parallel shard and context-parallel rank, without
        TP, HSDP or pipeline stages: the routed experts' FSDP unit (``expert_shard``) spans one
        rank, so its gathers and reductions are only copies and casts, done once a step (with
        ``default`` resharding and the memory to keep them: ``held_for_speed.fitted``)."""
        one_rank = self.experts is not None and 1 < self.experts.ep == self.dp_shard * self.cp
        return self.gathers_one_rank_experts and one_rank and self.tp == 1 and self.pp == 1

    @property
    def params(self) -> int:
        return self.n_layers * self.block_params + self.tables(True, True) * self.vocab_size * self.dim + self.dim

    @property
    def matrix_params(self) -> int:
        """Per block, the matrices Muon updates: all but the norms and a router."""
        router = self.dim * self.experts.n_experts if self.experts is not None else 0
        return self.block_params - 2 * self.dim - router * (self.n_layers - self.dense_layers) // self.n_layers
