"""How much memory one rank will need, estimated before the model is built.

A job that does not fit should say so in seconds, with the numbers and the settings that would
make it fit, instead of spending minutes initialising and then dying of an out-of-memory error
(or, on CPU, swapping the machine to a halt). :func:`estimate` adds up, per rank:

* **model state**: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, each sharded
  over ``dp_shard x cp`` (FSDP) and ``tp`` (replicas under HSDP hold their own copy); with
  ``training.defer_gradient_reduction`` the gradients accumulate unsharded;
* **FSDP buffers**: the gathered (unsharded) parameters of the block computing and the one
  prefetched, in the compute dtype, and one block's unsharded gradients before they are reduced;
  all blocks stay gathered with ``fsdp_reshard_after_forward = "never"``;
* **activations** of one micro-batch (tokens = local batch x seq_len / cp): per block, the tensors
  autograd keeps for backward in this model (``trainer/model/llama3.py``): the block and norm
  inputs, the all-gathered norm outputs that feed the projections, q/k/v (with the keys and values
  repeated for grouped-query attention), RoPE's float32 copies, the attention output, the four
  feed-forward intermediates. Tensor parallelism splits all but the all-gathered inputs.
  Activation checkpointing keeps only each checkpointed block's input plus one block being
  recomputed; ``op`` keeps the matmul and attention outputs. Context parallelism's
  ``allgather_kv`` attention also keeps the gathered keys and values of the whole sequence, and
  their repeats for grouped-query attention up to each local chunk's end; document masking
  keeps one additive attention mask (queries x keys, in the compute dtype) shared by all blocks;
* **logits and loss**: the logits of one micro-batch (vocabulary-sharded under loss parallel),
  their float32 copy, the log-softmax kept for backward and the gradient; with the chunked loss
  (``training.loss_chunk_tokens``) of one chunk of tokens, plus the final hidden states;
* **allocator slack**: memory freed by backward that the allocator cannot hand back or reuse
  at once. On CPU glibc's heap fragments as activations are freed and gradients allocated
  (measured here: the peak RSS exceeds the live activations by 13% with full checkpointing to
  50% without, and drops to the live size with ``MALLOC_MMAP_THRESHOLD_=65536``); the CUDA
  caching allocator loses less;
* **runtime**: what the framework holds whatever the model (CUDA context and NCCL buffers, or
  the CPU process's own memory).

The estimate is meant to be close, not exact: ``tests/test_memory_plan.py`` compares it with the
measured peak on CPU (docs/performance.md gives the figures).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

_GIB = 1024**3
RUNTIME_BYTES = {"cpu": int(0.40 * _GIB), "cuda": int(1.5 * _GIB)}
"""Memory a process holds before the model exists: torch's CPU runtime, or a CUDA context and
NCCL's buffers."""
ALLOCATOR_SLACK = {"cpu": 0.45, "cuda": 0.1}
"""Peak memory beyond the live activations, as a fraction of them (see the module docstring)."""


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
    seq_len: int
    dp_shard: int
    cp: int
    tp: int
    compute_bytes: int
    """Bytes per element of activations and gathered parameters (2 for bf16, 4 for fp32)."""
    ac_mode: str = "none"
    ac_option: str = "op"
    loss_parallel: bool = True
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the output projection and loss; 0: the whole micro-batch's logits."""
    defer_gradient_reduction: bool = False
    reshard_after_forward: str = "default"
    cp_allgather_kv: bool = True
    cp_ulysses: bool = False
    document_mask: bool = False
    device: str = "cpu"

    @property
    def block_params(self) -> int:
        head_dim = self.dim // self.n_heads
        attention = 2 * self.dim * self.n_heads * head_dim + 2 * self.dim * self.kv_heads * head_dim
        return attention + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def params(self) -> int:
        return self.n_layers * self.block_params + 2 * self.vocab_size * self.dim + self.dim


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes by part; :attr:`total` is the expected peak."""

    model_state: int
    fsdp_buffers: int
    activations: int
    logits: int
    allocator: int
    runtime: int

    @property
    def total(self) -> int:
        return self.model_state + self.fsdp_buffers + self.activations + self.logits + self.allocator + self.runtime

    def line(self) -> str:
        parts = (
            ("params+grads+AdamW", self.model_state),
            ("FSDP buffers", self.fsdp_buffers),
            ("activations", self.activations),
            ("logits", self.logits),
            ("allocator slack", self.allocator),
            ("runtime", self.runtime),
        )
        return f"{gib(self.total)} per rank = " + " + ".join(f"{gib(b)} {name}" for name, b in parts)


def gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def estimate(w: Workload) -> Estimate:
    shards = w.dp_shard * w.cp * w.tp
    grads = 4 * w.params / (w.tp if w.defer_gradient_reduction else shards)
    model_state = 4 * w.params / shards + grads + 8 * w.params / shards
    gathered_blocks = w.n_layers if w.reshard_after_forward == "never" else 2
    gathered = (gathered_blocks * w.block_params + w.vocab_size * w.dim) * w.compute_bytes / w.tp
    fsdp_buffers = gathered + w.block_params * (w.compute_bytes + 4) / w.tp
    activations = _activations(w) + _document_mask(w)
    device = w.device if w.device in RUNTIME_BYTES else "cpu"
    return Estimate(
        model_state=int(model_state),
        fsdp_buffers=int(fsdp_buffers),
        activations=int(activations),
        logits=int(_logits(w)),
        allocator=int(ALLOCATOR_SLACK[device] * activations),
        runtime=RUNTIME_BYTES[device],
    )


def _activations(w: Workload) -> float:
    """Bytes kept for backward by one micro-batch's blocks, with activation checkpointing."""
    tokens = w.local_batch_size * w.seq_len / w.cp
    d, kv, f, t, b = w.dim, w.dim * w.kv_heads // w.n_heads, w.ffn_dim, w.tp, w.compute_bytes
    # Per token: two all-gathered norm outputs (full width), then what tensor parallelism splits:
    # block and norm inputs, q, repeated k and v, attention output and its reshaped copy, and the
    # feed-forward's w1/w3 outputs, silu and product; plus RoPE's float32 copies of q and k.
    full_block = tokens * ((2 * d + (7 * d + kv + 4 * f) / t) * b + (d + kv) / t * 4)
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
    if w.ac_mode == "full":
        return w.n_layers * block_input + full_block
    if w.ac_mode == "selective" and w.ac_option == "op":
        # Kept: the projections' and attention's outputs (q, k, v, attention, wo, w1, w3, w2).
        return w.n_layers * tokens * (4 * d + 2 * kv + 2 * f) / t * b + full_block
    if w.ac_mode == "selective":
        every = int(w.ac_option)
        checkpointed = (w.n_layers + every - 1) // every
        return checkpointed * block_input + (w.n_layers - checkpointed + 1) * full_block
    return w.n_layers * full_block


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
    tokens = w.local_batch_size * w.seq_len / w.cp
    vocab = w.vocab_size / w.tp if w.loss_parallel else w.vocab_size
    float_copy = 4 if w.compute_bytes != 4 else 0
    # The logits, their float32 copy, the log-softmax kept for backward, and its gradient: of
    # one chunk of tokens at a time when the loss is chunked (recomputed in backward).
    live = min(tokens, w.loss_chunk_tokens) if w.loss_chunk_tokens > 0 else tokens
    return live * vocab * (w.compute_bytes + float_copy + 4 + 4) + tokens * w.dim * w.compute_bytes


# ------------------------------------------------------------------------------------ limits


def _meminfo(field: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _own_rss() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def cpu_limit_per_rank(local_ranks: int, started: bool) -> int | None:
    """This machine's available memory shared by its ranks (None where unknown).

    ``started``: called by a rank, whose siblings have started too and already hold about as
    much as this process (the estimate counts that as runtime), so it is added back.
    """
    available = _meminfo("MemAvailable")
    if available is None:
        return None
    if started:
        available += local_ranks * _own_rss()
    return available // max(local_ranks, 1)


def gpu_limit(device_index: int | None) -> int | None:
    """Total memory of one GPU: from torch in a rank (which owns a CUDA context anyway), from
    ``nvidia-smi`` in the launcher (so that it does not hold a CUDA context for the whole job)."""
    if device_index is not None:
        import torch

        return torch.cuda.get_device_properties(device_index).total_memory
    if not shutil.which("nvidia-smi"):
        return None
    query = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    sizes = [int(line) for line in query.stdout.split() if line.strip().isdigit()]
    return min(sizes) * 1024**2 if query.returncode == 0 and sizes else None


# ------------------------------------------------------------------------------- what fits


def fixes(w: Workload, limit: int, world_size: int) -> tuple[str, list[str]]:
    """Changes that would bring the estimate under ``limit``, as the user would type them.

    Returns ``("any", changes)`` when each change alone fits, else ``("all", changes)`` for one
    combination that fits, else ``("all", [])``.
    """
    single = []
    shards = _fitting_shards(w, limit)
    if shards is not None:
        single.append(_shard_text(w, shards, world_size // w.dp_shard * shards))
    for tp in _tp_degrees(w):
        if estimate(replace(w, tp=tp)).total <= limit:
            single.append(f"`--parallelism.tensor_parallel_degree {tp}` (with {world_size // w.tp * tp} processes)")
            break
    if w.ac_mode != "full" and estimate(replace(w, ac_mode="full")).total <= limit:
        single.append("`--activation_checkpoint.mode full`")
    for batch in range(w.local_batch_size - 1, 0, -1):
        if estimate(replace(w, local_batch_size=batch)).total <= limit:
            single.append(
                f"`--training.local_batch_size {batch}` (with `training.global_batch_size` set, the global "
                "batch stays and the micro-batches are more)"
            )
            break
    if single:
        return "any", single
    smallest = replace(w, ac_mode="full", local_batch_size=1)
    for tp in (w.tp, *_tp_degrees(w)):
        shards = _fitting_shards(replace(smallest, tp=tp), limit)
        if shards is not None:
            processes = world_size // (w.dp_shard * w.tp) * shards * tp
            return "all", [
                "`--activation_checkpoint.mode full`",
                "`--training.local_batch_size 1`",
                *([f"`--parallelism.tensor_parallel_degree {tp}`"] if tp != w.tp else []),
                _shard_text(w, shards, processes),
            ]
    return "all", []


def _tp_degrees(w: Workload) -> list[int]:
    return [tp for tp in (2, 4, 8) if tp > w.tp and w.n_heads % tp == 0 and w.kv_heads % tp == 0]


def _fitting_shards(w: Workload, limit: int) -> int | None:
    for shards in (w.dp_shard, *(2**k for k in range(1, 14))):
        if shards >= w.dp_shard and estimate(replace(w, dp_shard=shards)).total <= limit:
            return shards
    return None


def _shard_text(w: Workload, shards: int, processes: int) -> str:
    # A CPU machine's ranks share its memory: more shards fit only on more machines.
    where = " on more machines" if w.device != "cuda" else ""
    return f"dp_shard {shards} ({processes} processes in all{where}: NGPU x NNODES)"
