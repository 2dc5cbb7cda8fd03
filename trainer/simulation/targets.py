"""The machines a job can be simulated for (``--target-gpu NAME``) and the user's corrections.

A GPU's figures are the hardware table's (``trainer/hardware.py``), with the efficiencies and
latencies the simulator assumes. ``cpu`` is this machine: its RAM shared by the ranks of a node, and
matmul and copy rates measured in a fraction of a second, so the simulator can be checked against
real runs here. Any figure can be overridden on the command line (:data:`OVERRIDES`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from trainer import hardware
from trainer.hardware import ALLOCATOR_SLACK, RUNTIME_BYTES
from trainer.planning.target_figures import OVERRIDES, parse_overrides
from trainer.runtime.errors import ConfigError
from trainer.simulation.calibration import KINDS, Calibration
from trainer.simulation.calibration import load as calibration_of


@dataclass(frozen=True)
class Target:
    name: str
    memory_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per direction, between two GPUs of a node."""
    network_bytes_per_s: float
    """Per GPU, between nodes (one NIC per GPU)."""
    nvlink_alpha_s: float = 5e-6
    network_alpha_s: float = 10e-6
    efficiency: float = 0.5
    """Fraction of ``bf16_flops`` the matmuls reach."""
    hbm_efficiency: float = 0.7
    """Fraction of ``hbm_bytes_per_s`` the memory-bound ops reach."""
    runtime_bytes: int = RUNTIME_BYTES["cuda"]
    """Held whatever the model: the CUDA context and NCCL's buffers (the CPU process's own memory)."""
    allocator_slack: float = ALLOCATOR_SLACK["cuda"]
    """Memory the allocator holds beyond the live tensors, as a fraction of the peak's activations."""
    routing_imbalance: float = 1.0
    """Mixture-of-Experts: the routed tokens the busiest expert-parallel rank receives, over the
    average (a stated assumption: fake tensors route nothing); the simulated rank is that one."""
    calibration: Calibration | None = None
    """The rates measured on this GPU (``calibration.py``); None: the peaks x the efficiencies."""
    calibration_file: str = ""
    fp8_flops: float = 0.0
    """Dense float8 peak, at which the float8 matmuls run (``efficiency`` of it); 0: at ``bf16_flops``."""
    host_bytes_per_s: float = 64e9
    """Per direction, the GPU's link to host memory (the data sheet's)."""
    host_efficiency: float = 0.5
    """Fraction of ``host_bytes_per_s`` a pinned copy reaches while every GPU of the node copies
    (they share the host's memory and PCIe switches): stated, not measured."""

    @property
    def host_rate(self) -> float:
        """What copies between the device and host memory reach (held forwards in host memory)."""
        return self.host_bytes_per_s * self.host_efficiency

    def to_json(self) -> dict[str, object]:
        figures = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**figures, "calibration": self.calibration.to_json() if self.calibration else None}

    def float8_flops(self) -> float:
        """The rate float8 matmuls run at: the calibration's (``Calibration.float8_flops``), else
        the float8 peak x ``efficiency`` (the bf16 peak's where the GPU has no float8 cores)."""
        peak = self.fp8_flops or self.bf16_flops
        if self.calibration is not None and self.fp8_flops:
            rate, _ = self.calibration.float8_flops(self.bf16_flops, self.fp8_flops)
            if rate:
                return rate
        return peak * self.efficiency

    def calibration_line(self) -> str:
        """Which figures time the step: the calibration's, each with its source, or the constants."""
        constants = f"efficiency {self.efficiency} of the {self.bf16_flops / 1e12:.0f} TFLOP/s peak"
        constants += f", HBM efficiency {self.hbm_efficiency} of {self.hbm_bytes_per_s / 1e12:.3g} TB/s"
        c = self.calibration
        if c is None:
            why = "stated with --target.*" if self.calibration_file == STATED_BY_USER else "none stored"
            return f"calibration: {why}; {constants}"
        rates = []
        for kind in KINDS:
            rate, source = c.flops(kind)
            shown = f"{rate / 1e12:.0f} TFLOP/s" if rate else f"{self.bf16_flops * self.efficiency / 1e12:.0f} TFLOP/s"
            rates.append(f"{kind} {shown} ({source})")
        if self.fp8_flops:
            _, source = c.float8_flops(self.bf16_flops, self.fp8_flops)
            rates.append(f"float8 matmuls {self.float8_flops() / 1e12:.0f} TFLOP/s ({source})")
        bandwidth = f"{c.hbm_bytes_per_s / 1e12:.3g} TB/s (measured)" if c.hbm_bytes_per_s else "HBM x efficiency"
        casting = (
            f"{c.casting_bytes_per_s / 1e12:.3g} TB/s (measured)"
            if c.casting_bytes_per_s
            else "not measured: the copy's"
        )
        return (
            f"calibration: {self.calibration_file} ({c.gpu}, torch {c.torch}; {c.measured}): "
            + ", ".join(rates)
            + f", memory-bound {bandwidth}, casting kernels {casting}"
        )


GPUS: dict[str, Target] = {
    name: Target(
        name,
        gpu.memory_bytes,
        gpu.bf16_flops,
        gpu.hbm_bytes_per_s,
        gpu.nvlink_bytes_per_s,
        gpu.network_bytes_per_s,
        fp8_flops=gpu.fp8_flops,
        host_bytes_per_s=gpu.host_bytes_per_s,
    )
    for name, gpu in hardware.GPUS.items()
}
NAMES = (*GPUS, "cpu")
RATES = {"bf16_tflops", "efficiency", "hbm_tb_per_s", "hbm_efficiency"}
"""``--target.*`` figures that replace the calibration's measured rates."""
STATED_BY_USER = "-"


HELP = (
    "--simulate runs two training steps of one rank per pipeline stage on fake tensors and a fake process group of "
    "NGPU x NNODES ranks, and reports memory, FLOPs, communication and an estimated step time per "
    f"rank role. --target-gpu {{{','.join(NAMES)}}} (default h100) picks the machine; "
    + ", ".join(f"--target.{key}" for key in OVERRIDES)
    + " override its figures (e.g. --target-gpu h100 --target.memory_gib 75 --target.bf16_tflops 800)."
)


def cpu_target(ranks_per_node: int) -> Target:
    """This machine: its RAM per rank, and matmul / copy rates measured now (about 0.3 s)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    a = torch.randn(512, 512)
    flops = _rate(lambda: a @ a, 2 * 512**3)
    big = torch.empty(4 * 1024**2)
    copy_rate = _rate(lambda: big.clone(), 2 * big.numel() * 4)
    return Target(
        "cpu",
        total // max(ranks_per_node, 1),
        flops,
        copy_rate,
        nvlink_bytes_per_s=copy_rate / 4,
        network_bytes_per_s=1e9 / 8,
        nvlink_alpha_s=50e-6,
        network_alpha_s=100e-6,
        efficiency=1.0,
        hbm_efficiency=1.0,
        runtime_bytes=hardware.runtime_bytes("cpu", torch.backends.cuda.is_built()),
        allocator_slack=ALLOCATOR_SLACK["cpu"],
        host_bytes_per_s=copy_rate,
        host_efficiency=1.0,
    )


def _rate(work: object, units: float, seconds: float = 0.15) -> float:
    work()  # type: ignore[operator]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        work()  # type: ignore[operator]
        done += 1
    return units * done / (time.perf_counter() - start)


def target_named(name: str | None, overrides: dict[str, str], ranks_per_node: int) -> Target:
    """The target of ``--target-gpu NAME`` (h100 when not given) with the ``--target.*`` overrides."""
    name = (name or "h100").lower()
    if name not in NAMES:
        raise ConfigError(f"--target-gpu {name}: not one of {', '.join(NAMES)}.")
    return resolve_target(name, parse_overrides(overrides), ranks_per_node)


def resolve_target(name: str, overrides: dict[str, float], ranks_per_node: int) -> Target:
    """A GPU's figures with its stored calibration, unless the user states a rate or an
    efficiency (``--target.bf16_tflops`` and the like), which then rules."""
    target = cpu_target(ranks_per_node) if name == "cpu" else GPUS[name]
    if name != "cpu":
        if RATES & overrides.keys():
            target = replace(target, calibration_file=STATED_BY_USER)
        else:
            calibration, path = calibration_of(name)
            target = replace(target, calibration=calibration, calibration_file=path)
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        field, unit = OVERRIDES[key]
        changes[field] = int(value * unit) if field.endswith("_bytes") else value * unit
    return replace(target, **changes)
