"""Training metrics: what a step costs (``accounting``), where and when figures go (``logger``:
the console, and the sinks ``tensorboard_sink`` and ``wandb_sink``), what TensorBoard's tags and
dashboard are (``dashboard``), and what the run says when it starts and ends (``reports``)."""

from trainer.metrics.accounting import (
    PEAK_BF16_FLOPS,
    MemoryStats,
    device_memory,
    flops_per_token,
    model_flops_per_token,
    peak_flops,
    tokens_per_second_per_device,
)
from trainer.metrics.dashboard import DASHBOARD_ALIASES
from trainer.metrics.logger import (
    CONSOLE_TTY_ENV,
    MetricsLogger,
    format_duration,
    use_color,
)

__all__ = [
    "CONSOLE_TTY_ENV",
    "DASHBOARD_ALIASES",
    "PEAK_BF16_FLOPS",
    "MemoryStats",
    "MetricsLogger",
    "device_memory",
    "flops_per_token",
    "format_duration",
    "model_flops_per_token",
    "peak_flops",
    "tokens_per_second_per_device",
    "use_color",
]
