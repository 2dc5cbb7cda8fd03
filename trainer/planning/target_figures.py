"""The figures a user states for the machine a job is planned for (``--target.KEY VALUE``).

Parsed and checked once, where the request is read, so that the pre-launch estimate (memory,
runtime, allocator slack), the memory limit and the simulator (every figure) all plan for the same
machine: a figure the estimate ignored would let ``--dry-run`` pass a job the user has just said
does not fit.
"""

from __future__ import annotations

import math

from trainer.hardware import GIB
from trainer.runtime.errors import ConfigError

OVERRIDES: dict[str, tuple[str, float]] = {
    "memory_gib": ("memory_bytes", GIB),
    "bf16_tflops": ("bf16_flops", 1e12),
    "hbm_tb_per_s": ("hbm_bytes_per_s", 1e12),
    "nvlink_gb_per_s": ("nvlink_bytes_per_s", 1e9),
    "network_gbit_per_s": ("network_bytes_per_s", 1e9 / 8),
    "nvlink_alpha_us": ("nvlink_alpha_s", 1e-6),
    "network_alpha_us": ("network_alpha_s", 1e-6),
    "efficiency": ("efficiency", 1.0),
    "hbm_efficiency": ("hbm_efficiency", 1.0),
    "runtime_gib": ("runtime_bytes", GIB),
    "allocator_slack": ("allocator_slack", 1.0),
    "routing_imbalance": ("routing_imbalance", 1.0),
    "host_gb_per_s": ("host_bytes_per_s", 1e9),
    "host_efficiency": ("host_efficiency", 1.0),
}
"""``--target.KEY VALUE`` -> the target's field it sets and the unit it is given in."""

LIMITS: dict[str, tuple[float, float, str]] = {
    "efficiency": (0.0, 1.0, "a fraction of the peak, above 0 and at most 1"),
    "hbm_efficiency": (0.0, 1.0, "a fraction of the bandwidth, above 0 and at most 1"),
    "host_efficiency": (0.0, 1.0, "a fraction of the host link, above 0 and at most 1"),
    "allocator_slack": (0.0, 2.0, "a fraction of the activations, from 0 to 2 (CUDA's default is 0.1)"),
    "runtime_gib": (0.0, 1024.0, "GiB, from 0 to 1024"),
    "routing_imbalance": (1.0, 64.0, "the busiest expert-parallel rank's routed tokens over the average, from 1 to 64"),
    "nvlink_alpha_us": (0.0, 1e6, "microseconds, from 0"),
    "network_alpha_us": (0.0, 1e6, "microseconds, from 0"),
}
"""Figures that are fractions or may be 0: ``(low, high, what)``, low exclusive for the
efficiencies, inclusive otherwise. Every other figure is a positive, finite amount."""


def parse_overrides(overrides: dict[str, str]) -> dict[str, float]:
    """``--target.KEY VALUE`` as given: each a known figure and a finite number in its range."""
    parsed: dict[str, float] = {}
    for field, text in overrides.items():
        key = f"--target.{field}"
        if field not in OVERRIDES:
            raise ConfigError(f"{key}: no such target figure; use one of {', '.join(OVERRIDES)}.")
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{key} {text}: not a number.") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key} {text}: must be a finite number.")
        low, high, what = LIMITS.get(field, (0.0, math.inf, "a positive amount"))
        above_low = value > low if field.endswith("efficiency") or field not in LIMITS else value >= low
        if not (above_low and value <= high):
            raise ConfigError(f"{key} {text}: out of range; it is {what}.")
        parsed[field] = value
    return parsed
