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
from trainer.planning.per_rank_bytes import Estimate
from trainer.planning.workload import Workload


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
