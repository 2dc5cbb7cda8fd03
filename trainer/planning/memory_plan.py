"""How much memory one rank will need, estimated before the model is built.

A job that does not fit should say so in seconds, with the numbers and the settings that would
make it fit, instead of spending minutes initialising and then dying of an out-of-memory error
(or, on CPU, swapping the machine to a halt). :func:`estimate` adds up, per rank:

* **model state**: fp32 parameters, fp32 gradients and AdamW's two fp32 moments (Muon's one
  momentum buffer for the blocks' matrices: ``trainer/muon.py``), each sharded
  over ``dp_shard x cp`` (FSDP) and ``tp`` (replicas under HSDP hold their own copy); with
  ``training.defer_gradient_reduction`` the gradients accumulate unsharded, in the reduce dtype.
  With one micro-batch per step on CUDA, backward frees each block's activations as it makes
  the block's gradients, so the peak holds the activations and logits or the gradients,
  whichever are larger (only what the gradients exceed them by is counted); with gradient
  accumulation, the gradients of the earlier micro-batches are held throughout;
* **FSDP buffers**: the gathered (unsharded) parameters of the block computing and the one
  prefetched, in the compute dtype, and one block's unsharded gradients before they are reduced;
  all blocks stay gathered with ``fsdp_reshard_after_forward = "never"``;
* **activations** of one micro-batch (tokens = local batch x seq_len / cp): per block, the tensors
  autograd keeps for backward in this model (``trainer/model/llama3.py``): the block and norm
  inputs, the all-gathered norm outputs that feed the projections, q/k/v (with the keys and values
  repeated for grouped-query attention), RoPE's float32 copies, the attention output, the four
  feed-forward intermediates. Tensor parallelism splits all but the all-gathered inputs.
  Activation checkpointing keeps only each checkpointed block's input plus one block being
  recomputed (with exact MoE balancing under full checkpointing, those of every micro-batch of
  the step: ``Workload.holds_forwards``); ``op`` keeps the matmul and attention outputs. Context parallelism's
  ``allgather_kv`` attention also keeps the gathered keys and values of the whole sequence, and
  their repeats for grouped-query attention up to each local chunk's end; document masking
  keeps one additive attention mask (queries x keys, in the compute dtype) shared by all blocks;
* **Mixture-of-Experts blocks**: the routed experts' state and gathered weights under EP, the
  routed tokens' activations at the stated routing imbalance and the token exchange's buffers,
  instead of the dense feed-forward's (``moe_memory.py``). Under TP the MoE's weights are
  gathered whole (TP splits only the dense layers) and its tokens are the rank's sequence shard;
* **logits and loss**: the logits of one micro-batch (vocabulary-sharded under loss parallel),
  their float32 copy, the log-softmax kept for backward and the gradient; with the chunked loss
  (``training.loss_chunk_tokens``) of one chunk of tokens, plus the final hidden states. Backward
  frees them before it recomputes the first checkpointed block, so on CUDA that block counts only
  by what it exceeds them by;
* **pipeline stages**: under pipeline parallelism each ``pp`` rank holds its stages' blocks, the
  embedding on the first stage, the final norm and output on the last
  (``parallelisms/pipeline_split.py`` splits them; the estimate is the largest rank's).
  torch's ``PipelineStage`` keeps FSDP from resharding after backward and from reducing
  gradients until the step's last micro-batch, so a rank holds its stages' parameters gathered
  and their gradients unsharded (in the reduce dtype) for most of the step; with tensor
  parallelism the first stage's embedding backward also makes the whole vocabulary's gradient,
  in the compute dtype and in the reduce dtype, at that moment. Activations are
  those of the micro-batches in flight: ``GPipe`` runs every forward before any backward (all
  of them, and the last stage keeps every micro-batch's logits); ``1F1B`` keeps ``pp - r`` on
  rank ``r`` (``pp`` on the first); the multi-stage schedules keep what torch's interleaved
  warm-up leaves, ``(v - 1) pp + 2 (pp - 1 - r) + 1`` stage micro-batches of ``v`` stages per
  rank (zero-bubble schedules are counted the same, without their deferred weight-gradient
  inputs). Each in-flight micro-batch also keeps its stage's output for the send;
* **allocator slack**: memory freed by backward that the allocator cannot hand back or reuse
  at once. On CPU glibc's heap fragments as activations are freed and gradients allocated
  (measured here: the peak RSS exceeds the live activations by 13% with full checkpointing to
  50% without, and drops to the live size with ``MALLOC_MMAP_THRESHOLD_=65536``); the CUDA
  caching allocator loses less;
* **runtime**: what the framework holds whatever the model (CUDA context and NCCL buffers, or
  the CPU process's own memory, a CUDA build's libraries included).

The estimate is meant to be close, not exact: ``tests/test_memory_plan.py`` compares it with the
measured peak on CPU (docs/performance.md gives the figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelisms.pipeline_split import plan_split
from trainer.hardware import ALLOCATOR_SLACK, RUNTIME_BYTES, runtime_bytes
from trainer.planning.moe_memory import RoutedExperts
from trainer.planning.per_rank_bytes import Estimate


@dataclass(frozen=True)
class Latents:
    """A latent attention's widths (``trainer/model/mla.py``), for its parameters and activations."""

    q_rank: int
    """0: queries projected straight from the input."""
    kv_rank: int
    qk_head: int
    """A query or key head: the part without position and the RoPE part."""
    rope_head: int
    v_head: int


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
    """A latent attention's (DeepSeek-V3); None: grouped-query attention."""
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
            return self.n_heads * self.latents.qk_head, self.n_heads * self.latents.qk_head
        head_dim = self.head_dim or self.dim // self.n_heads
        return self.n_heads * head_dim, self.kv_heads * head_dim

    @property
    def attention_params(self) -> int:
        q, kv = self.widths
        if (la := self.latents) is None:
            return 2 * self.dim * (q + kv)
        queries = self.dim * la.q_rank + la.q_rank + la.q_rank * q if la.q_rank else self.dim * q
        heads = self.n_heads * (la.qk_head - la.rope_head + la.v_head)
        keys_values = self.dim * (la.kv_rank + la.rope_head) + la.kv_rank + la.kv_rank * heads
        return queries + keys_values + self.n_heads * la.v_head * self.dim

    @property
    def attention_kept(self) -> float:
        """Per token, the widths of what one block's attention keeps for backward beside the
        all-gathered norm output, as if tensor parallelism split them all (``_activations``)."""
        q, kv = self.widths
        if (la := self.latents) is None:
            # q, repeated k and v, the attention output and its reshaped copy; k and v unrepeated.
            return 5 * q + kv
        # The replicated latents (and their norms), every rank's whole; then the heads' up-
        # projections, q and k put together from their parts (q scaled by YaRN's temperature),
        # v padded to the query's width, the attention output, its value channels reshaped.
        latent = 2 * la.q_rank + 2 * la.kv_rank + la.rope_head
        up = q + self.n_heads * (la.qk_head - la.rope_head + la.v_head)
        return latent * self.tp + up + 5 * q + self.n_heads * la.v_head

    @property
    def rope_width(self) -> int:
        """Per token, the channels RoPE rotates (in float32): every query and key head's, or a
        latent attention's RoPE part of each query head and the one shared key."""
        if (la := self.latents) is None:
            return sum(self.widths)
        return (self.n_heads + 1) * la.rope_head

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


@dataclass(frozen=True)
class _Share:
    """What one pipeline rank holds and keeps in flight (the whole model without pipelining)."""

    pp_rank: int | None
    blocks: int
    first: bool
    last: bool
    microbatches: float
    """Micro-batches of the rank's blocks whose activations are kept at the peak."""
    logits: int
    """Micro-batches whose logits are kept (on the last stage)."""


def estimate(w: Workload) -> Estimate:
    """The rank that needs the most (the ranks differ only by their pipeline stages)."""
    return max(estimates(w), key=lambda e: e.total)


def estimates(w: Workload) -> list[Estimate]:
    """One estimate per pipeline rank, in pipeline order (one without pipelining)."""
    return [_estimate(w, share) for share in _shares(w)]


def _shares(w: Workload) -> list[_Share]:
    if w.pp == 1 and w.holds_forwards:
        # Every micro-batch's forward is held until the step's backwards; its logits too when
        # it fits one chunk of the loss (not recomputed then) and its gradients are not held.
        whole = w.local_batch_size * w.seq_len / w.cp <= w.loss_chunk_tokens and not w.holds_loss_gradients
        held = min(w.accumulation, 2) if w.offloads_forwards else w.accumulation
        return [_Share(None, w.n_layers, True, True, held, held if whole else 1)]
    if w.pp == 1:
        return [_Share(None, w.n_layers, True, True, 1, 1)]
    split = plan_split(w.n_layers, w.pp, w.pp_schedule, w.pp_layers_per_stage, w.pp_first_less, w.pp_last_less)
    m, pp, per_rank = w.pp_microbatches, w.pp, split.stages_per_rank
    shares = []
    for rank in range(pp):
        stages = split.rank_stages(rank)
        blocks = sum(len(split.stage_blocks[s]) for s in stages)
        if w.pp_schedule == "GPipe":
            in_flight = float(m)
        elif per_rank == 1:
            in_flight = float(min(m, pp - rank))
        else:
            stage_microbatches = min(m * per_rank, (per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1)
            in_flight = stage_microbatches / per_rank
        last = split.num_stages - 1 in stages
        logits = (m if w.pp_schedule == "GPipe" else 1) if last else 0
        shares.append(_Share(rank, blocks, 0 in stages, last, in_flight, logits))
    return shares


def _estimate(w: Workload, share: _Share) -> Estimate:
    shards = w.dp_shard * w.cp * w.tp
    params = (
        share.blocks * w.block_params + w.vocab_size * w.dim * w.tables(share.first, share.last) + w.dim * share.last
    )
    moments = 8 * params - (4 * share.blocks * w.matrix_params if w.muon else 0)  # AdamW's two, Muon's one
    sharded_state = (4 * params + moments) / shards
    kept, recomputed = _activations(w, share)
    logits = share.logits * _logits(w)
    # CUDA's caching allocator reuses what backward frees (the loss's tensors before the first
    # recompute, activations as gradients come); glibc's heap on CPU does not (measured:
    # benchmarks/simulator_vs_measured.py, full checkpointing), so there both are counted.
    reuses = w.device == "cuda"
    activations = kept + (max(0.0, recomputed - logits) if reuses else recomputed) + _document_mask(w)
    unsharded = w.unsharded(share.blocks, share.first, share.last)
    if w.pp > 1:
        # PipelineStage defers FSDP's reshard and reduce to the step's last backward.
        grads = w.reduce_bytes * unsharded
        if share.first and w.tp > 1:
            # DTensor's backward of the vocabulary-sharded embedding makes the whole table's
            # gradient, then FSDP's copy in the reduce dtype, while the other micro-batches
            # in flight and the stage's unsharded gradients are held (seen by --simulate).
            table = w.vocab_size * w.dim
            grads += table * (w.compute_bytes + w.reduce_bytes) - table * w.reduce_bytes / w.tp
        fsdp_buffers = (unsharded + w.gathered_block) * w.compute_bytes
    else:
        deferred = w.defer_gradient_reduction and w.accumulation > 1
        grads = w.reduce_bytes * unsharded if deferred else 4 * params / shards
        if w.accumulation == 1 and reuses:
            # Backward frees a block's activations as it makes its gradients: with no gradients
            # kept from an earlier micro-batch, the peak holds the larger of the two.
            grads = max(0.0, grads - activations - logits)
        gathered_blocks = w.n_layers if w.reshard_after_forward == "never" else 2
        block_bytes = 1 if w.float8_all_gather else w.compute_bytes
        gathered = gathered_blocks * w.gathered_block * block_bytes + w.vocab_size * w.dim / w.tp * w.compute_bytes
        if w.experts_stay_gathered and w.experts is not None:
            held = max(0, w.n_layers - w.dense_layers - gathered_blocks)
            gathered += held * w.experts.routed_params(w.dim) * w.compute_bytes
        fsdp_buffers = gathered + w.gathered_block * (w.compute_bytes + 4)
    device = w.device if w.device in RUNTIME_BYTES else "cpu"
    return Estimate(
        model_state=int(sharded_state + grads),
        fsdp_buffers=int(fsdp_buffers),
        activations=int(activations),
        logits=int(logits),
        allocator=int((ALLOCATOR_SLACK[device] if w.allocator_slack is None else w.allocator_slack) * activations),
        runtime=runtime_bytes(device, w.cuda_build) if w.runtime_bytes is None else w.runtime_bytes,
        pp_rank=share.pp_rank,
        params=params,
        optimizer=int(muon_exchange(w, share.blocks)) if w.muon else 0,
    )


def muon_exchange(w: Workload, blocks: int) -> float:
    """Bytes Muon's optimizer step holds beside the model state, when the activations are gone:
    the largest stack of one kind of matrix (the stage's blocks of it, or one layer's routed
    experts), as fp32 local shards, fp32 whole matrices of the rank's share, their bf16 copy and
    the Newton–Schulz products (about two more bf16 copies): 16 bytes an element over the shards."""
    q = w.widths[0]
    dense = blocks * max(q * w.dim, w.dim * w.ffn_dim) / (w.dp_shard * w.cp * w.tp)
    experts = 0.0
    if w.experts is not None and w.dense_layers < w.n_layers:
        experts = w.experts.n_experts * w.dim * w.experts.hidden / (w.dp_shard * w.cp)
    return 16 * max(dense, experts)


def _activations(w: Workload, share: _Share) -> tuple[float, float]:
    """Bytes kept for backward by the micro-batches in flight through the rank's blocks, with
    activation checkpointing; and those of the one block being recomputed in backward."""
    tokens = w.local_batch_size * w.seq_len / w.cp
    (q, kv), d, f, t, b = w.widths, w.dim, w.ffn_dim, w.tp, w.compute_bytes
    # Per token: two all-gathered norm outputs (full width), then what tensor parallelism splits:
    # block and norm inputs, q, repeated k and v, attention output and its reshaped copy, and the
    # feed-forward's w1/w3 outputs, silu and product; plus RoPE's float32 copies of q and k.
    full_block = tokens * ((2 * d + (2 * d + w.attention_kept) / t) * b + w.rope_width / t * 4)
    if w.cp > 1 and w.cp_allgather_kv:
        # Both query chunks of a rank attend to keys up to their ends: (2 cp + 1) / (2 cp) of
        # the sequence in all, repeated to every head, for k and v, instead of the local tokens.
        sequence = w.local_batch_size * w.seq_len
        repeated = 2 * d / t * (sequence * (2 * w.cp + 1) / (2 * w.cp) - tokens)
        full_block += (repeated + 2 * kv / t * sequence) * b
    if w.cp > 1 and w.cp_ulysses:
        # The all-to-all's q, k, v in head layout and again in natural order (k and v with their
        # key/value heads repeated until cp divides them), and the output in rank order.
        kv_heads = max(w.kv_heads // t, 1)
        replicated = kv / t * (w.cp // math.gcd(kv_heads, w.cp))
        full_block += tokens * (3 * d / t + 4 * replicated) * b
    block_input = tokens * d / t * b
    blocks = share.blocks
    # Mixture-of-Experts blocks: their feed-forward's instead of the dense one's (moe_memory.py).
    moe_share = 1 - w.dense_layers / w.n_layers
    ex = w.experts
    dense_ffn, op_ffn = tokens * 4 * f / t * b, tokens * 2 * f / t * b
    # Under TP a MoE block routes the rank's sequence shard, from the norm's shard: not the
    # all-gathered norm output that full_block counts for the dense feed-forward.
    routed_tokens, gathered_norm = tokens / t, tokens * (d - d / t) * b
    moe_ffn = routed_tokens * ex.kept(d, b) - gathered_norm if ex else 0.0
    exchange = routed_tokens * ex.exchange(d, b) if ex and moe_share else 0.0
    average = full_block + dense_ffn + moe_share * (moe_ffn - dense_ffn)
    full_block += max(dense_ffn if moe_share < 1 else 0.0, moe_ffn + exchange if moe_share else 0.0)
    if w.ac_mode == "full":
        kept = blocks * block_input
    elif w.ac_mode == "selective" and w.ac_option == "op":
        # Kept: the projections' and attention's outputs (q, k, v, attention, wo, w1, w3, w2).
        moe_op = routed_tokens * ex.kept_op(d, b) if ex else 0.0
        kept = blocks * (tokens * (2 * q + 2 * d + 2 * kv) / t * b + op_ffn + moe_share * (moe_op - op_ffn))
    elif w.ac_mode == "selective":
        checkpointed = (blocks + int(w.ac_option) - 1) // int(w.ac_option)
        kept = checkpointed * block_input + (blocks - checkpointed) * average
    else:
        kept, full_block = blocks * average, exchange
    stage_output = block_input if w.pp > 1 and not share.last else 0.0
    # Held forwards: the final norm's input and output of every micro-batch but the one ``_logits``
    # counts; or the norm's input and the loss's gradients (hidden states, output weight) of each.
    held = 2 * block_input * (share.microbatches - 1) if w.holds_forwards else 0.0
    if w.holds_loss_gradients:
        held += share.microbatches * w.vocab_size * d * b
    return share.microbatches * (kept + stage_output) + held, full_block


def _document_mask(w: Workload) -> float:
    """The attention mask, kept once for every block: queries x keys per sample (also under
    Ulysses CP, which attends whole sequences), or under all-gather-K/V CP its two query chunks
    of ``seq / 2cp`` tokens against the keys up to each chunk's end."""
    if not w.document_mask:
        return 0.0
    if w.cp == 1 or w.cp_ulysses:
        return w.local_batch_size * w.seq_len**2 * w.compute_bytes
    chunk = w.seq_len / (2 * w.cp)
    return w.local_batch_size * chunk**2 * (2 * w.cp + 1) * w.compute_bytes


def _logits(w: Workload) -> float:
    """One micro-batch's: the logits, their float32 copy, the log-softmax kept for backward and
    its gradient, and the final norm's output."""
    tokens = w.local_batch_size * w.seq_len / w.cp
    vocab = w.vocab_size / w.tp if w.loss_parallel else w.vocab_size
    float_copy = 4 if w.compute_bytes != 4 else 0
    # The logits, their float32 copy, the log-softmax kept for backward, and its gradient: of
    # one chunk of tokens at a time when the loss is chunked (recomputed in backward).
    live = min(tokens, w.loss_chunk_tokens) if w.loss_chunk_tokens > 0 else tokens
    return live * vocab * (w.compute_bytes + float_copy + 4 + 4) + tokens * w.dim * w.compute_bytes
