"""The initialisation's draw rule written out plainly, for a whole tensor at once: what the tiled,
sharded, threaded and banded ``tiled_init`` must reproduce bit for bit on every mesh and device.

It shares no code with ``tiled_init``: the tile grid, the seed of each tile and the mapping of a
tile's uniforms through ``erfinv`` are spelled out here again from their description, so that a
change to either side shows as a difference instead of moving both."""

from __future__ import annotations

import hashlib
import itertools
import math

import torch

from trainer.model.llama3 import ModelArgs, Transformer, rope_frequencies


def reference_draw(shape: tuple[int, ...], kind: str, std: float, seed: int, name: str) -> torch.Tensor:
    """Every tile of a ``shape`` tensor drawn in one process on the CPU: tiles are 32 x 1024 over
    the last two dimensions (1024 for a vector) and one index of any dimension before them; tile
    ``(i, j, ...)`` draws from a CPU generator seeded with the first 8 bytes (little-endian) of
    BLAKE2b of ``"seed/name/i,j,..."``: ``normal(0, std)``, or for ``trunc_normal`` uniforms
    over ``(-erf(3 / sqrt 2), erf(3 / sqrt 2))`` later mapped to ``erfinv(u) * std * sqrt 2``
    and clamped at 3 std."""
    tile = (1024,) if len(shape) == 1 else (1,) * (len(shape) - 2) + (32, 1024)
    full = torch.empty(shape)
    edge = math.erf(3.0 / math.sqrt(2.0))
    for index in itertools.product(*(range(-(-n // t)) for n, t in zip(shape, tile))):
        box = tuple(slice(i * t, (i + 1) * t) for i, t in zip(index, tile))
        key = f"{seed}/{name}/{','.join(str(i) for i in index)}".encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        block = torch.empty(full[box].shape)
        if kind == "normal":
            block.normal_(0.0, std, generator=gen)
        else:
            block.uniform_(-edge, edge, generator=gen)
        full[box] = block
    if kind == "trunc_normal":
        full = (full.erfinv() * (std * math.sqrt(2.0))).clamp(-3 * std, 3 * std)
    return full


def reference_state(args: ModelArgs, seed: int) -> dict:
    """The whole model's initial weights (``state``) and RoPE table (``freqs``) by the plain rule,
    for the unsplit model's shapes (a stack of experts as one tensor)."""
    with torch.device("meta"):
        model = Transformer(args)
    state = {}
    for name, param in model.named_parameters():
        kind, std = model.init_std(name)
        shape = tuple(param.shape)
        state[name] = torch.ones(shape) if kind == "ones" else reference_draw(shape, kind, std, seed, name)
    return {"state": state, "freqs": rope_frequencies(args, device="cpu")}
