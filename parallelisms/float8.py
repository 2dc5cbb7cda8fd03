"""Float8 training of the linear layers, through torchao (an optional extra: ``pip install -e ".[float8]"``).

A converted ``nn.Linear`` keeps its high-precision weight as the parameter (so state-dict keys,
checkpoints and the Hugging Face export are those of a bf16 run: a float8 run resumes in bf16 and
back) and casts weight, input and output gradient to float8 inside each matmul, with scales from
the tensors' absolute maxima. The recipe says over what those maxima are taken:

* ``tensorwise``: one scale per tensor. The input's amax is over the whole micro-batch on this
  rank, so a token's rounding depends on the other tokens it is batched with: the loss depends on
  how a global batch is split into ranks and micro-batches. With FSDP2 the weight can be cast
  before the all-gather (half the bytes); its scale then comes from an all-reduced amax over the
  whole weight, precomputed for all layers in one all-reduce after each optimizer step.
* ``rowwise``: one scale per row of the contracted dimension. The forward and the input gradient
  scale each token on its own, so the loss does not depend on the split; the weight gradient
  contracts over tokens, so its scales are per micro-batch and the gradients do.
* ``rowwise_with_gw_hp``: as ``rowwise``, with the weight gradient in high precision: loss and
  gradients are the same on every data-parallel layout and accumulation count.

Converted before any other parallelism (``parallelize.py``), on the meta device. Not converted:
the output projection and the MoE router (their precision matters most and they are small), and
any linear whose dimensions the float8 kernels cannot take (not multiples of 16).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelisms.parallel_dims import ParallelismError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
KERNEL_MULTIPLE = 16
"""``torch._scaled_mm`` takes only dimensions that are multiples of 16."""
ALWAYS_HIGH_PRECISION = ("output", "router.gate")
"""Module names (or their endings) never converted: the output projection and the MoE router."""


@dataclass(frozen=True)
class Float8Settings:
    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = False
    """``tensorwise`` under FSDP2: all-gather the weights in float8."""
    precompute_scales: bool = False
    """With the float8 all-gather: one all-reduce of every weight's amax after the optimizer step."""
    filter_fqns: tuple[str, ...] = ()
    """Further module names (or their endings) to keep in high precision."""
    experts: bool = False
    """The MoE's routed experts through torchao's float8 grouped matmul (rowwise)."""
    emulate: bool = False
    """Float8 matmuls as float32 matmuls of the float8-rounded operands: the same rounding, at a
    CPU's speed (``torch._scaled_mm`` on CPU is about a thousand times slower)."""


def torchao_version() -> str | None:
    """The installed torchao's version, or None when it is not installed."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return importlib.metadata.version("torchao")


def check_float8(settings: Float8Settings, *, n_experts: int, device_type: str) -> None:
    """Raise :class:`ParallelismError` for a float8 setting that cannot work; before any process group."""
    if torchao_version() is None:
        raise ParallelismError('{float8}: float8 training needs torchao; install it with `pip install -e ".[float8]"`.')
    if settings.recipe not in RECIPES:
        raise ParallelismError(f"{{float8_recipe}} = {settings.recipe!r}: use one of {', '.join(RECIPES)}.")
    if settings.fsdp_float8_all_gather and settings.recipe != "tensorwise":
        raise ParallelismError(
            f"{{float8_all_gather}} casts each weight with one scale before the all-gather: it needs "
            f'{{float8_recipe}} = "tensorwise", not {settings.recipe!r}.'
        )
    if settings.precompute_scales and not settings.fsdp_float8_all_gather:
        raise ParallelismError(
            "{float8_precompute} precomputes the scales of the float8 all-gather: also turn on {float8_all_gather}."
        )
    if settings.experts:
        _check_experts(n_experts, device_type)


def _check_experts(n_experts: int, device_type: str) -> None:
    if not n_experts:
        raise ParallelismError(
            "{float8_experts} converts the routed experts of a Mixture-of-Experts model: "
            'set {model_name} = "moe" or "deepseek_v3".'
        )
    capable = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    if not capable:
        raise ParallelismError(
            f"{{float8_experts}}: torchao {torchao_version()}'s float8 grouped matmul needs an NVIDIA GPU of compute "
            f"capability 9.0 or newer (H100/H200) with torch {torch.__version__}; this machine runs {device_type}. "
            "Turn it off here."
        )


def check_backend(settings: Float8Settings | None, dp_shard: int, backend: str, tp: int = 1) -> None:
    """Refuse, before the process group starts, a float8 all-gather over a backend that cannot
    move float8 tensors (gloo). Not in :func:`check_float8`: a job planned or simulated on a CPU
    for a GPU (``--simulate``) gathers over NCCL or a fake group."""
    if settings is not None and settings.fsdp_float8_all_gather and dp_shard > 1 and backend == "gloo":
        raise ParallelismError(
            "{float8_all_gather} all-gathers float8 tensors, which gloo cannot move; it needs CUDA (NCCL). "
            "Turn it off on this machine."
        )
    if settings is not None and settings.recipe == "tensorwise" and tp > 1 and backend == "gloo":
        raise ParallelismError(
            '{float8_recipe} = "tensorwise" with {tp} > 1 all-gathers the sequence-parallel inputs in float8, '
            'which gloo cannot move; it needs CUDA (NCCL). Use "rowwise" or "rowwise_with_gw_hp" here.'
        )


def convertible(fqn: str, module: nn.Module, filter_fqns: tuple[str, ...] = ()) -> bool:
    """Whether the linear layer at ``fqn`` trains in float8."""
    if type(module) is not nn.Linear:  # the output projection is a subclass that may compute the loss
        return False
    names = ALWAYS_HIGH_PRECISION + filter_fqns
    if any(fqn == name or fqn.endswith("." + name) for name in names):
        return False
    return module.in_features % KERNEL_MULTIPLE == 0 and module.out_features % KERNEL_MULTIPLE == 0


@dataclass(frozen=True)
class Float8Conversion:
    """What :func:`convert_to_float8` did to a whole model, for the start report."""

    converted: tuple[str, ...]
    """The converted linears' names."""
    linears: tuple[str, ...]
    """Every linear layer's name (converted or not)."""
    notices: tuple[str, ...] = ()
    """What torchao's import said that a float8 run does not use (:func:`import_torchao`)."""

    def describe(self, stages: nn.Module | None = None) -> str:
        """One line: how many linears train in float8 and which stayed high precision; with
        ``stages`` (a pipeline rank's part of the model), how many of them it holds."""
        kept = [fqn for fqn in self.linears if fqn not in self.converted]
        kinds = sorted({fqn.split(".")[-1] for fqn in self.converted})
        kept_kinds = sorted({".".join(fqn.split(".")[-2:]) if "router" in fqn else fqn.split(".")[-1] for fqn in kept})
        line = (
            f"{len(self.converted)} of {len(self.linears)} linear layers in float8 ({', '.join(kinds) or 'none'}); "
            f"kept in high precision: {', '.join(kept_kinds) or 'none'}"
        )
        if stages is not None:
            here = {fqn for fqn, m in stages.named_modules() if isinstance(m, nn.Linear)}
            if len(here) < len(self.linears):
                line += f"; this rank's pipeline stages hold {len(here & set(self.converted))} of the converted"
        return line


QUIET_TORCHAO = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
"""What importing torchao logs as warnings that float8 training does not use: its own C++/CUDA
extensions (MX formats, CUTLASS kernels of other recipes, which a CPU build of torch cannot load),
Triton (its int8 kernels) and torch's deprecation notices about how torchao registers its enums.
Float8 training runs on ``torch._scaled_mm``, or emulated on a CPU."""


class _Collect(logging.Filter):
    """Keeps the records :data:`QUIET_TORCHAO` names out of the log, counting them."""

    def __init__(self, starts: tuple[str, ...], seen: list[str]):
        super().__init__()
        self.starts, self.seen = starts, seen

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(part in message for part in self.starts):
            self.seen.append(message)
            return False
        return True


def import_torchao(experts: bool = False) -> tuple[str, ...]:
    """Import ``torchao.float8`` (with ``experts``, its grouped matmul's prototype too) with the
    warnings of :data:`QUIET_TORCHAO` kept out of the log, and return one line saying what they
    were (empty when torchao was imported already, or said none)."""
    seen: list[str] = []
    filters = {name: _Collect(starts, seen) for name, starts in QUIET_TORCHAO.items()}
    for name, quiet in filters.items():
        logging.getLogger(name).addFilter(quiet)
    try:
        importlib.import_module("torchao.float8")
        if experts:
            importlib.import_module("torchao.prototype.moe_training")
    finally:
        for name, quiet in filters.items():
            logging.getLogger(name).removeFilter(quiet)
    if not seen:
        return ()
    extensions = sum("Failed to load" in m or "Skipping import" in m for m in seen)
    notices = sum("Enum subclass" in m for m in seen)
    parts = [
        *([f"{extensions} of its C++/CUDA extensions not loaded"] if extensions else []),
        *(["no Triton"] if any("triton" in m for m in seen) else []),
        *([f"{notices} torch deprecation notice{'s' * (notices > 1)}"] if notices else []),
    ]
    return (
        f"torchao {torchao_version()} reported {', '.join(parts)}: float8 training uses none of them "
        "(it runs on torch._scaled_mm, emulated on a CPU)",
    )


def check_filters(model: nn.Module, filter_fqns: tuple[str, ...]) -> None:
    """Raise :class:`ParallelismError` for a ``filter_fqns`` entry that matches no linear layer
    :func:`convertible` would convert: it would keep nothing in high precision."""
    names = [fqn for fqn, module in model.named_modules() if convertible(fqn, module)]
    for name in filter_fqns:
        if not any(fqn == name or fqn.endswith("." + name) for fqn in names):
            ends = sorted({".".join(fqn.split(".")[-2:]) for fqn in names})
            raise ParallelismError(
                f"{{float8_filter}} names {name!r}, which neither is nor ends the name of a linear layer float8 "
                f"converts, so it keeps nothing in high precision (the output layer, the router and odd-sized "
                f"linears stay there anyway): name one of {', '.join(ends)}, or a full name such as "
                f"{names[0]!r}, or drop it."
            )


def convert_to_float8(model: nn.Module, settings: Float8Settings) -> Float8Conversion:
    """Swap every :func:`convertible` linear of ``model`` for torchao's ``Float8Linear`` in place
    (and, with ``settings.experts``, route the experts' matmuls through float8); say which."""
    notices = import_torchao(settings.experts)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = tuple(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear))
    config = Float8LinearConfig.from_recipe_name(settings.recipe)
    config = dataclasses.replace(
        config, enable_fsdp_float8_all_gather=settings.fsdp_float8_all_gather, emulate=settings.emulate
    )
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = convertible(fqn, module, settings.filter_fqns)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if settings.experts:
        for module in model.modules():
            if hasattr(module, "grouped_mm"):
                setattr(module, "grouped_mm", float8_grouped_mm)  # noqa: B010 - a plain attribute of the experts
    return Float8Conversion(tuple(converted), linears, notices)


def float8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The experts' grouped matmul with both operands cast to float8 rowwise (torchao's prototype)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b, offsets, out_dtype=a.dtype, pad_token_groups_for_grouped_mm=False
    )


def precompute_scales(modules: list[nn.Module]) -> None:
    """After the optimizer step: every float8-gathered weight's amax in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for module in modules:
        precompute_float8_dynamic_scale_for_fsdp(module)


def tensor_parallel_styles(settings: Float8Settings | None) -> dict[str, Any]:
    """The TP styles of the converted linears: torchao's float8 styles (inputs all-gathered in
    float8) for ``tensorwise``; for the rowwise recipes, whose scales torchao's styles cannot
    carry, the plain ones (None)."""
    if settings is None or settings.recipe != "tensorwise":
        return {}
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel, "prepare": PrepareFloat8ModuleInput}
