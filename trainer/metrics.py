"""Training metrics: throughput/MFU accounting, console lines and TensorBoard.

The trainer hands one :class:`StepStats` per optimizer step to
:class:`MetricsLogger`, which owns every decision about *when* and *where*
metrics go. Keeping that out of the training loop means the loop never pays for
formatting or I/O on steps that are not logged, and every rank can call
``log`` unconditionally while only the configured ranks actually emit.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("meshtrain")

_GIB = 1024**3

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendor datasheets.
# Keys are substrings that must all appear in ``torch.cuda.get_device_name()``
# (case-insensitive). The first matching entry wins, so variants that share a
# family name with a faster part (H100 NVL/PCIe vs. SXM) must come first.
PEAK_BF16_FLOPS: dict[tuple[str, ...], float] = {
    ("H100", "NVL"): 835e12,
    ("H100", "PCIe"): 756e12,
    ("H100",): 989e12,
    ("H200",): 989e12,
    ("A100",): 312e12,
    ("B200",): 2.25e15,
}


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
        "Unknown peak bf16 FLOP/s for GPU %r; MFU will not be reported. "
        "Set the peak FLOPs override to enable it.",
        name,
    )
    return None


def flops_per_token(num_params_non_embedding: int, n_layers: int, dim: int, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token.

    ``6·N`` covers the matmuls against the weights (2 forward, 4 backward per
    parameter); ``12·L·d·S`` adds the attention score and value matmuls, which
    have no parameters but grow with sequence length. This is the same
    estimate torchtitan uses, so MFU numbers are comparable across the two.
    """
    return 6 * num_params_non_embedding + 12 * n_layers * dim * seq_len


def tokens_per_second_per_device(tokens: int, seconds: float, devices_per_replica: int) -> float:
    """Throughput per device, as torchtitan counts it.

    ``tokens`` are those one data-parallel replica processed; the replica's
    ``devices_per_replica`` (tensor x context parallel) devices share them, so
    TP or CP does not inflate the figure.
    """
    return tokens / (seconds * devices_per_replica) if seconds > 0 else 0.0


def device_memory(device: torch.device) -> tuple[float, float | None]:
    """Peak memory in GiB since the previous call: ``(active, reserved)``.

    On CUDA the peaks are reset after reading so each logged line reflects the
    steps since the last line, not the whole run. ``reserved`` (what the caching
    allocator holds) is the number that predicts OOMs, ``active`` is what the
    tensors actually need. On CPU there is no allocator to ask, so this falls
    back to the process peak RSS, which is a lifetime peak and cannot be reset.
    """
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        return (
            stats.get("active_bytes.all.peak", 0) / _GIB,
            stats.get("reserved_bytes.all.peak", 0) / _GIB,
        )
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
    return rss_bytes / _GIB, None


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the trainer measured in one optimizer step.

    Losses and ``n_valid_tokens`` are expected to be already reduced across
    ranks (global values) so every rank would log the same numbers, while
    ``local_tokens`` stays per-process because throughput is reported per
    device.
    """

    step: int
    loss_avg: float
    loss_max: float
    grad_norm: float
    lr: float
    n_valid_tokens: int
    local_tokens: int
    n_skipped_steps: int
    """Steps skipped so far in the run (counted by the train state, restored on resume)."""
    data_time_s: float
    step_time_s: float
    skip_reason: str = ""
    """Why this step's optimizer step was skipped (empty when it was not)."""


_ANSI = {
    "reset": "\033[0m",
    "red": "\033[31m",
    "green": "\033[32m",
    "yellow": "\033[33m",
    "blue": "\033[34m",
    "magenta": "\033[35m",
    "cyan": "\033[36m",
    "white": "\033[37m",
}

_TAG_LOSS_AVG = "loss_metrics/global_avg_loss"
_TAG_LOSS_MAX = "loss_metrics/global_max_loss"
_TAG_GRAD_NORM = "grad_norm"
_TAG_LR = "lr"
_TAG_VALID_TOKENS = "n_valid_tokens"
_TAG_TOKENS_SEEN = "n_tokens_seen"
_TAG_TPS = "throughput(tps)"
_TAG_TFLOPS = "tflops"
_TAG_MFU = "mfu(%)"
_TAG_MEM_ACTIVE = "memory/max_active(GiB)"
_TAG_MEM_RESERVED = "memory/max_reserved(GiB)"
_TAG_STEP_TIME = "time_metrics/end_to_end(s)"
_TAG_DATA_PCT = "time_metrics/data_loading(%)"
_TAG_SKIPPED = "n_skipped_steps"


def format_duration(seconds: float) -> str:
    """h:mm:ss, with hours allowed past 24 so long runs stay readable at a glance."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class MetricsLogger:
    """Accumulates per-step stats and emits them on log steps.

    Emission happens on step 1 (to show the run is alive and catch setup
    problems early), every ``log_freq`` steps, and on the final step so the
    last values are never lost. Throughput and timing are averaged over all
    steps since the previous emission, so logging less often does not make
    the numbers noisier or hide slow steps.
    """

    def __init__(
        self,
        *,
        rank: int,
        console: bool,
        dump_folder: str,
        tb_folder: str,
        enable_tensorboard: bool,
        log_freq: int,
        color: bool,
        device: torch.device,
        total_steps: int,
        flops_per_token: int,
        peak_flops: float | None,
        global_tokens_per_step: int,
        devices_per_replica: int = 1,
    ) -> None:
        self._console = console
        self._log_freq = log_freq
        self._colors = _ANSI if color else dict.fromkeys(_ANSI, "")
        self._device = device
        self._total_steps = total_steps
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops
        self._global_tokens_per_step = global_tokens_per_step
        self._devices_per_replica = devices_per_replica
        self._device_total_gib = (
            torch.cuda.get_device_properties(device).total_memory / _GIB
            if device.type == "cuda"
            else None
        )

        self._window_steps = 0
        self._window_tokens = 0
        self._window_data_time = 0.0
        self._window_step_time = 0.0
        self._n_skipped_steps = 0

        self.tb_dir: str | None = None
        self._writer: SummaryWriter | None = None
        if rank == 0 and enable_tensorboard:
            # Imported lazily so runs without TensorBoard installed still work
            # when it is disabled.
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = os.path.join(
                dump_folder, tb_folder, datetime.now().strftime("%Y%m%d-%H%M%S")
            )
            self._writer = SummaryWriter(log_dir=self.tb_dir)
            self._writer.add_custom_scalars(self._dashboard_layout())

    def _dashboard_layout(self) -> dict[str, dict[str, list[str | list[str]]]]:
        """Custom-scalars layout so related curves share one chart.

        TensorBoard treats each tag in the layout as a regex matched from the
        start of the tag name; escaping and anchoring keeps tags such as
        ``mfu(%)`` from being read as regex groups or matching longer names.
        Charts for GPU-only tags are left out on CPU to avoid empty panels.
        """

        def chart(*tags: str) -> list[str | list[str]]:
            return ["Multiline", [re.escape(t) + "$" for t in tags]]

        on_gpu = self._device.type == "cuda"
        throughput = {"tokens/s per device": chart(_TAG_TPS), "TFLOP/s": chart(_TAG_TFLOPS)}
        if self._peak_flops is not None:
            throughput["MFU %"] = chart(_TAG_MFU)
        memory_tags = [_TAG_MEM_ACTIVE, _TAG_MEM_RESERVED] if on_gpu else [_TAG_MEM_ACTIVE]
        return {
            "loss": {"loss": chart(_TAG_LOSS_AVG, _TAG_LOSS_MAX)},
            "optimizer": {
                "grad norm": chart(_TAG_GRAD_NORM),
                "learning rate": chart(_TAG_LR),
                "skipped steps": chart(_TAG_SKIPPED),
            },
            "throughput": throughput,
            "memory": {"peak memory (GiB)": chart(*memory_tags)},
            "data": {
                "tokens": chart(_TAG_TOKENS_SEEN),
                "valid tokens per step": chart(_TAG_VALID_TOKENS),
                "step time (s)": chart(_TAG_STEP_TIME),
                "data loading %": chart(_TAG_DATA_PCT),
            },
        }

    def log(self, stats: StepStats) -> None:
        """Record one step; emit a console line / TensorBoard point on log steps."""
        self._window_steps += 1
        self._window_tokens += stats.local_tokens
        self._window_data_time += stats.data_time_s
        self._window_step_time += stats.step_time_s
        self._n_skipped_steps = stats.n_skipped_steps

        if not (
            stats.step == 1 or stats.step % self._log_freq == 0 or stats.step == self._total_steps
        ):
            return
        # Summed step times rather than a wall clock between calls: time spent
        # outside steps (checkpointing, evaluation) should not show up as a
        # throughput dip.
        window_time = self._window_step_time
        tps = tokens_per_second_per_device(self._window_tokens, window_time, self._devices_per_replica)
        tflops = self._flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / self._peak_flops if self._peak_flops is not None else None
        mean_step_time = window_time / self._window_steps
        data_pct = 100 * self._window_data_time / window_time if window_time > 0 else 0.0
        mem_active, mem_reserved = device_memory(self._device)

        if self._console:
            eta = mean_step_time * (self._total_steps - stats.step)
            logger.info(self._console_line(stats, mem_active, mem_reserved, tps, tflops, mfu, eta))
        if self._writer is not None:
            scalars: dict[str, float] = {
                _TAG_LOSS_AVG: stats.loss_avg,
                _TAG_LOSS_MAX: stats.loss_max,
                _TAG_GRAD_NORM: stats.grad_norm,
                _TAG_LR: stats.lr,
                _TAG_VALID_TOKENS: stats.n_valid_tokens,
                _TAG_TOKENS_SEEN: self._global_tokens_per_step * stats.step,
                _TAG_TPS: tps,
                _TAG_TFLOPS: tflops,
                _TAG_MEM_ACTIVE: mem_active,
                _TAG_STEP_TIME: mean_step_time,
                _TAG_DATA_PCT: data_pct,
                _TAG_SKIPPED: self._n_skipped_steps,
            }
            if mfu is not None:
                scalars[_TAG_MFU] = mfu
            if mem_reserved is not None:
                scalars[_TAG_MEM_RESERVED] = mem_reserved
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, stats.step)
            # Flushing per emitted step keeps the curves up to date for a run
            # that gets killed (OOM, preemption) before close().
            self._writer.flush()

        self._window_steps = 0
        self._window_tokens = 0
        self._window_data_time = 0.0
        self._window_step_time = 0.0

    def _console_line(
        self,
        stats: StepStats,
        mem_active: float,
        mem_reserved: float | None,
        tps: float,
        tflops: float,
        mfu: float | None,
        eta_s: float,
    ) -> str:
        """One human-readable line; ``:.4f`` etc. render non-finite values as nan/inf."""
        c = self._colors
        if mem_reserved is not None and self._device_total_gib is not None:
            # Reserved memory is what runs out first, so that is the headline number.
            pct = 100 * mem_reserved / self._device_total_gib
            memory = f"{mem_reserved:.2f}GiB ({pct:.1f}%)"
        else:
            memory = f"{mem_active:.2f}GiB"
        fields = [
            f"{c['cyan']}step: {stats.step}/{self._total_steps}",
            f"{c['green']}loss: {stats.loss_avg:.4f}",
            f"{c['green']}max loss: {stats.loss_max:.4f}",
            f"{c['yellow']}grad norm: {stats.grad_norm:.4f}",
            f"{c['blue']}memory: {memory}",
            f"{c['magenta']}tps: {tps:,.0f}",
            f"{c['magenta']}tflops: {tflops:.2f}",
        ]
        if mfu is not None:
            fields.append(f"{c['magenta']}mfu: {mfu:.2f}%")
        fields.append(f"{c['white']}eta: {format_duration(eta_s)}")
        if self._n_skipped_steps:
            fields.append(f"{c['red']}skipped steps: {self._n_skipped_steps}")
        return "  ".join(fields) + c["reset"]

    def close(self) -> None:
        """Flush and release the TensorBoard writer; safe to call more than once."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
