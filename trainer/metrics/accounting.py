"""What a step costs and what it achieves: FLOPs per token, peak FLOP/s of the device (for MFU),
tokens per second per device, and peak device memory, counted as torchtitan counts them so
runs of the two compare figure by figure."""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.hardware import GIB, PEAK_BF16_FLOPS
from trainer.model.llama3 import ModelArgs, num_params, whole_model
from trainer.model.moe import MoEArgs, active_params

logger = logging.getLogger("meshtrain")


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``, or None when MFU is meaningless.

    CPUs have no comparable "peak" so MFU is only reported on CUDA devices.
    ``override`` exists because the table cannot know about power-capped,
    clock-locked or newer GPUs; it takes precedence over the table so a user
    can always correct the MFU denominator.
    """
    if override is not None and override <= 0:
        raise ValueError(f"peak FLOPs override must be positive, got {override}")
    if device.type != "cuda":
        return None
    if override is not None:
        return override
    name = torch.cuda.get_device_name(device)
    lowered = name.lower()
    for substrings, flops in PEAK_BF16_FLOPS.items():
        if all(s.lower() in lowered for s in substrings):
            return flops
    logger.warning(
        "Unknown peak bf16 FLOP/s for GPU %r; MFU will not be reported. Set the peak FLOPs override to enable it.",
        name,
    )
    return None


def flops_per_token(num_params_non_embedding: int, n_layers: int, attention_width: float, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token.

    ``6·N`` covers the matmuls against the weights (2 forward, 4 backward per
    parameter); ``12·L·h·q·S`` adds the attention score and value matmuls over the
    ``h`` query heads of ``q`` channels (``attention_width``, the width unless heads are
    sized apart from it, as Qwen3's; for a latent attention the mean of its query-key and
    value heads' widths, ``ModelArgs.attention_width``), which have no parameters but grow
    with sequence length. This is the same estimate torchtitan uses, so MFU numbers are comparable.
    """
    return 6 * num_params_non_embedding + round(12 * n_layers * attention_width * seq_len)


def model_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """:func:`flops_per_token` of the whole model ``args`` describes, whatever share of it a rank
    holds. A Mixture-of-Experts token meets only its router, its shared experts and its top-k
    routed experts (and the dense first blocks): those are the parameters it costs, not every
    expert, or the MFU of a 128-expert model would be counted 10x too high. A tied output's
    matrix is counted once, as the output projection's (``num_params``)."""
    params = num_params(whole_model(args), exclude_embedding=True)
    if isinstance(args, MoEArgs):
        params = active_params(args, params)
    return flops_per_token(params, args.n_layers, args.attention_width, seq_len)


def tokens_per_second_per_device(tokens: int, seconds: float, devices_per_replica: int) -> float:
    """Throughput per device, as torchtitan counts it.

    ``tokens`` are those one data-parallel replica processed; the replica's
    ``devices_per_replica`` (tensor x context parallel) devices share them, so
    TP or CP does not inflate the figure.
    """
    return tokens / (seconds * devices_per_replica) if seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Peak memory since the previous :func:`device_memory` call, as torchtitan reports it.

    Only ``active_gib`` exists on every device; the rest is None where the device
    cannot tell (CPU), so nothing is logged that would have to be made up.
    """

    active_gib: float
    reserved_gib: float | None = None
    active_pct: float | None = None
    """``active_gib`` as a share of the device's total memory."""
    reserved_pct: float | None = None
    num_alloc_retries: int | None = None
    """Times the caching allocator freed its cache and retried (cumulative): the sign of a run near OOM."""
    num_ooms: int | None = None
    """Out-of-memory errors the allocator raised (cumulative), including caught ones."""


def device_memory(device: torch.device) -> MemoryStats:
    """Peak memory since the previous call.

    On CUDA the peaks are reset after reading so each logged line reflects the
    steps since the last line, not the whole run; the retry and OOM counts are
    cumulative (``reset_peak_memory_stats`` leaves them), as in torchtitan.
    ``reserved`` (what the caching allocator holds) is the number that predicts
    OOMs, ``active`` is what the tensors actually need.

    On CPU there is no allocator to ask, so ``active`` falls back to the process
    peak RSS, a lifetime peak that cannot be reset, and there is no percentage:
    the "device" is the host's RAM, shared with the other ranks and processes on
    it, so one process's share of it would suggest headroom that is not there.
    """
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        active = stats.get("active_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return MemoryStats(
            active_gib=active / GIB,
            reserved_gib=reserved / GIB,
            active_pct=100 * active / total,
            reserved_pct=100 * reserved / total,
            num_alloc_retries=stats.get("num_alloc_retries", 0),
            num_ooms=stats.get("num_ooms", 0),
        )
    return MemoryStats(active_gib=peak_rss_bytes() / GIB)


def peak_rss_bytes() -> int:
    """This process's own peak resident memory. On Linux ``VmHWM``: ``ru_maxrss`` survives
    ``exec``, so a worker started from a larger process (a test runner, a notebook) would report
    its parent's peak. macOS has only ``ru_maxrss``, in bytes."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024
