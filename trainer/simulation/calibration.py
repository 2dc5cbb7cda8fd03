"""What a GPU's kernels measured on that GPU: the figures ``--simulate`` times a step with when it
has them, instead of the data sheet's peaks times one assumed efficiency.

A single ``efficiency`` of 0.5 made the simulator 19-31% pessimistic on one H200 and 10-14%
optimistic against torchtitan's 8-GPU runs (docs/performance.md): matmuls of different shapes,
attention, the experts' grouped matmul and memory-bound ops each reach their own fraction of the
peak. The device check (``scripts/gpu/check.py``) measures them as kernel probes, never from its
whole-job rows (those stay the test of the prediction), and writes one JSON file per GPU; a
developer commits it to ``trainer/simulation/calibrations/<target>.json``. A figure the probes
have not measured yet is ``null`` and falls back to the nearest measured one of its kind, which
the report names.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).with_name("calibrations")
ENV = "MESHTRAIN_CALIBRATION"
"""A calibration file that stands for the stored one of its target (the device check's simulations
read the probes it has just measured)."""

GEMM_CLASSES = ("large", "medium", "small")
"""Dense matmuls by their smallest dimension (M, N or K): at least 4096, at least 1024, less. A
GPU's tiles fill less of it, and waves quantise worse, as a dimension shrinks."""
GEMM_PROBES = {"large": (8192, 8192, 8192), "medium": (8192, 2048, 2048), "small": (8192, 4096, 512)}
"""``(M, N, K)`` each class is measured at: the 8B shape's square products, the 1B's and the
30B-A3B's projections, and the grouped-query key and value projections."""
KINDS = (*(f"gemm_{c}" for c in GEMM_CLASSES), "attention", "grouped_gemm")


def gemm_class(m: int, n: int, k: int) -> str:
    smallest = min(m, n, k)
    return "large" if smallest >= 4096 else "medium" if smallest >= 1024 else "small"


@dataclass(frozen=True)
class Calibration:
    """Rates measured on one GPU; ``None`` where not measured yet."""

    gpu: str
    """``torch.cuda.get_device_name()`` of the GPU measured."""
    torch: str
    measured: str
    """When and how: the date, and the check's probes or the figures the file started from."""
    gemm_flops: dict[str, float | None]
    """Dense bf16 matmul FLOP/s by shape class (:data:`GEMM_CLASSES`)."""
    attention_flops: float | None
    """bf16 causal SDPA, forward and backward, FLOP/s counted as the cost model counts them
    (causal: half the score and value products)."""
    grouped_gemm_flops: float | None
    """The experts' grouped matmul (``torch._grouped_mm``), FLOP/s."""
    hbm_bytes_per_s: float | None
    """A device-to-device copy, bytes read and written per second: what memory-bound ops reach."""
    probes: dict[str, Any] = field(default_factory=dict)
    """The raw measurements behind the rates (shapes, times), for whoever reads the file."""
    float8_gemm_flops: float | None = None
    """The large class's matmul in float8 (``torch._scaled_mm``, one scale per operand), FLOP/s."""
    casting_bytes_per_s: float | None = None
    """Eager kernels that cast each element (``eager_kernels.py``: ``fp32 += bf16``, a bf16 -> fp32
    copy), bytes read and written per second; ``None``: timed at the copy's rate."""

    def float8_flops(self, bf16_peak: float, fp8_peak: float) -> tuple[float | None, str]:
        """Float8 matmul FLOP/s and where it comes from: its probe, or, not measured, the float8
        peak at the fraction of its peak the large bf16 matmul reached here (the same tensor cores
        and tiles; an assumption until the probe runs). ``None`` where neither is measured."""
        if self.float8_gemm_flops:
            return self.float8_gemm_flops, "measured"
        bf16 = self.gemm_flops.get("large")
        if bf16 and fp8_peak:
            return fp8_peak * bf16 / bf16_peak, "not measured: the float8 peak x the large bf16 matmul's fraction"
        return None, "not measured: peak x efficiency"

    def flops(self, kind: str) -> tuple[float | None, str]:
        """FLOP/s for ``kind`` (:data:`KINDS`) and where it comes from: its own probe, or for a
        dense class not measured, the nearest measured class; ``None`` where nothing stands in
        (the cost model then uses the target's peak x ``efficiency``)."""
        if not kind.startswith("gemm_"):
            rate = self.attention_flops if kind == "attention" else self.grouped_gemm_flops
            return (rate, "measured") if rate else (None, "not measured: peak x efficiency")
        wanted = GEMM_CLASSES.index(kind.removeprefix("gemm_"))
        for c in sorted(GEMM_CLASSES, key=lambda c: abs(GEMM_CLASSES.index(c) - wanted)):
            rate = self.gemm_flops.get(c)
            if rate:
                return rate, "measured" if GEMM_CLASSES.index(c) == wanted else f"not measured: the {c} class's"
        return None, "not measured: peak x efficiency"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load(target: str) -> tuple[Calibration | None, str]:
    """The calibration of ``target`` and the file it came from (``None, ""`` when none is stored)."""
    override = os.environ.get(ENV)
    path = Path(override) if override else FOLDER / f"{target}.json"
    if not path.is_file():
        return None, ""
    data = json.loads(path.read_text())
    if data.get("target", target) != target:
        return None, ""
    data.pop("target", None)
    return Calibration(**data), str(path)
