"""Rotary position embeddings: the table of rotations, Llama 3.1's frequency scaling, and the
rotation of query and key pairs (Meta's layout: adjacent channels ``(2j, 2j + 1)`` of a head)."""

from __future__ import annotations

import math

import torch

# Llama 3.1's RoPE scaling constants (the same for every Llama 3.1 and 3.2 model; only the
# factor differs): the Hugging Face adapter writes them into config.json and accepts no others.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def frequencies(
    dim: int,
    theta: float,
    max_seq_len: int,
    llama31_scale: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Complex rotations ``exp(i * pos * freq)`` of a ``dim``-channel head, shape
    ``(max_seq_len, dim // 2)``; ``llama31_scale``: Llama 3.1's scaling by that factor."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64)[: dim // 2] / dim))
    if llama31_scale is not None:
        freqs = _llama31_scaling(freqs, llama31_scale)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def _llama31_scaling(freqs: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """Llama 3.1's context extension: slow the low frequencies by ``scale_factor``, keep the high ones.

    Wavelengths longer than the original context / low_freq_factor are divided by the scale
    factor, shorter than context / high_freq_factor are kept, and the band between is blended.
    """
    low_freq_factor, high_freq_factor, old_context = (
        LLAMA3_LOW_FREQ_FACTOR,
        LLAMA3_HIGH_FREQ_FACTOR,
        LLAMA3_ORIGINAL_CONTEXT,
    )
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scale_factor + smooth * freqs
    return torch.where(
        wavelen > low_freq_wavelen,
        freqs / scale_factor,
        torch.where(wavelen < high_freq_wavelen, freqs, blended),
    )


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key pairs; ``freqs_cis`` is ``(seqlen, head_dim // 2)``, or
    ``(batch, seqlen, head_dim // 2)`` when every sample has its own positions."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(-1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def yarn_frequencies(
    dim: int,
    theta: float,
    max_seq_len: int,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    magnitude: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """YaRN's rotations (DeepSeek-V2/V3's long context): the frequencies that turn fewer than
    ``beta_slow`` times over ``original_context`` slowed by ``factor``, those turning more than
    ``beta_fast`` times kept, a linear ramp between (over whole channel pairs); ``magnitude``
    scales the rotations (YaRN's attention factor, 1 for DeepSeek's published configs)."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float64)[: dim // 2] / dim
    freqs = 1.0 / theta**exponents

    def pair_of(rotations: float) -> float:
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(pair_of(beta_fast)), 0), min(math.ceil(pair_of(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    freqs = freqs / factor * ramp + freqs * (1 - ramp)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), freqs)
    return torch.polar(torch.full_like(angles, magnitude), angles).to(torch.complex64)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
