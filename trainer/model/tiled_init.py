"""Random initialisation that is the same on every mesh yet costs a rank only its own shard.

Each parameter is cut into fixed tiles of ``TILE`` (rows x columns, over its last two
dimensions; edge tiles are smaller), and every tile is drawn whole from a generator of its
own, seeded from ``(seed, parameter name, tile index)``. A value thus depends only on where it
lies in the global tensor, never on the mesh, the sharding or the order of initialisation. A
rank draws the tiles that overlap the part of the tensor it holds and copies out the overlap.

That part is one contiguous box of the global tensor for every layout the trainer makes: FSDP's
``Shard(0)`` in uneven ``torch.chunk`` pieces, HSDP, TP's column-wise ``Shard(0)`` and row-wise
``Shard(1)`` (the embedding's rows too), and FSDP over TP DTensors (``_StridedShard``: FSDP
chunks a TP rank's contiguous slice again). ``local_box`` reads it from
``compute_local_shape_and_global_offset``; the tests check every one of these layouts bitwise
against one process drawing the whole tensor.

The tile shape, 32 x 1024 (32 Ki values, 128 KiB in float32), follows the cuts. Rows are cut by
FSDP at ``torch.chunk`` boundaries, after column-wise TP has cut them ``tp`` ways, so at scale a
rank holds few rows (405B's ``wq`` over tp 8 x dp_shard 128: 16 rows): tiles are short. Columns
are cut only by row-wise TP, into at most ``tp`` (<= 8) pieces of ``dim / tp`` or
``hidden / tp`` columns, 512 or more for 8B and larger: tiles can be wide. A rank holding an
``h x w`` box draws at most ``(h + 62) x (w + 2046)`` values, never more than the tensor, and
no slack where the cuts fall on tile edges (1B over 4 FSDP ranks: each draws exactly a
quarter). Drawing 32 Ki values takes several times a tile's fixed cost (seeding, one kernel,
one copy: ~40 us on CPU, a few kernel launches on GPU), so the tiling costs one process little
(``benchmarks/startup.py``).

Truncated normals are drawn by inversion: each tile draws uniforms over the truncated range of
``erf``, and the rank then maps only its own values through ``erfinv`` in one elementwise pass
(the same function of each value wherever it lies, so still mesh-independent). That is one
uniform per value, and none of the host syncs and whole-tensor redraws of torch 2.13's
``trunc_normal_``, a rejection sampler. Plain normals are drawn per tile with ``normal_``.

Every value is drawn on the CPU, whatever device holds the parameter, so that a seed is one model
on every device: a CUDA generator's stream is not the CPU's (the debug model started at loss
8.1750 on a GPU against 8.0976 on the CPU), and ``erfinv`` on a GPU need not round as the
CPU's does. A parameter elsewhere receives its box in bands copied from CPU memory; the tiles
are shared among threads, as many as the rank's share of the host's cores. The bits are those
of torch's CPU kernels (mt19937, its ``normal_`` and ``erfinv``), the same on the CPU of the
GPU's host as on the machine that rehearsed the run, provided both run the same CPU kernels;
drawing every value on the CPU costs a GPU job start-up time (``benchmarks/init_device.py``,
docs/performance.md).

The CPU generator (mt19937) keeps the low 32 bits of a seed, so among millions of tiles two may
share a stream.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import dtensor

TILE: tuple[int, int] = (32, 1024)
TRUNCATE_AT_STD = 3.0
"""Truncated normals are cut at +-3 std."""

KINDS = ("normal", "trunc_normal")
BAND_VALUES = 1 << 24
"""Values a tensor off the CPU receives per copy (64 MiB of float32 in host memory)."""
MIN_TILES_PER_THREAD = 8
"""A box of fewer tiles per thread than this is drawn on one thread: a thread's start costs
about what a few tiles do."""


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of the part of ``param``'s global tensor that this rank holds."""
    if not isinstance(param, DTensor):
        return (0,) * param.ndim, tuple(param.shape)
    shape, offset = dtensor.local_shape_and_offset(param)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(
            f"a {tuple(param.shape)} DTensor placed {param.placements} holds {tuple(param.to_local().shape)} "
            f"locally, not the {tuple(shape)} box its placements describe"
        )
    return tuple(offset), tuple(shape)


def stacked_box(owner: object, param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape, global shape)`` of the part of the whole model's tensor that this rank
    holds of ``param``, a parameter of module ``owner``.

    A module that holds some slices of a stacked parameter (expert parallelism's experts) says
    which with ``first_expert`` and ``n_experts``: its parameter is then a DTensor (or a tensor)
    of its own slices only, and the box moves to their place in the whole stack. Initialisation
    and Hugging Face imports read by this box, so both are the same on every EP degree.
    """
    offset, shape = local_box(param)
    whole = tuple(param.shape)
    first = getattr(owner, "first_expert", None)
    if first is not None:
        offset, whole = (offset[0] + first, *offset[1:]), (owner.n_experts, *whole[1:])  # type: ignore[attr-defined]
    return offset, shape, whole


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank's shard of ``param`` holds."""
    offset, shape = local_box(param)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def tile_shape(ndim: int) -> tuple[int, ...]:
    """Tiles span ``TILE`` over the last two dimensions and one index of any before them."""
    return (1,) * max(0, ndim - len(TILE)) + TILE[max(0, len(TILE) - ndim) :]


def tile_seed(seed: int, name: str, index: tuple[int, ...]) -> int:
    """A 64-bit seed from the run's seed, the parameter's name and the tile's grid index."""
    key = f"{seed}/{name}/{','.join(map(str, index))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


@torch.no_grad()
def fill_local_(
    local: torch.Tensor,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    kind: str,
    std: float,
    seed: int,
    name: str,
    threads: int | None = None,
) -> None:
    """Fill ``local``, the box of ``global_shape`` starting at ``offset``, with the values the
    tiles of parameter ``name`` give it: ``normal(0, std)`` or ``trunc_normal(0, std)`` cut at
    ``TRUNCATE_AT_STD`` std.

    The values are drawn on the CPU whatever ``local``'s device, so that a seed means the same
    weights on every device; a tensor elsewhere receives them band by band (at most
    ``BAND_VALUES`` at a time, cut on tile rows so that no tile is drawn twice). ``threads``
    draw the tiles (default :func:`draw_threads`); no value depends on how many."""
    if kind not in KINDS:
        raise ValueError(f"unknown initialisation {kind!r}; expected one of {KINDS}")
    if local.numel() == 0:
        return
    threads = draw_threads() if threads is None else threads
    if local.device.type == "cpu" and local.dtype == torch.float32:
        draw_box_(local, global_shape, offset, kind, std, seed, name, threads)
        return
    for first, stop in bands(global_shape, offset, tuple(local.shape)):
        values = torch.empty((stop - first, *local.shape[1:]), dtype=torch.float32)
        draw_box_(values, global_shape, (first, *offset[1:]), kind, std, seed, name, threads)
        local[first - offset[0] : stop - offset[0]].copy_(values)


def draw_threads() -> int:
    """This process's share of the host's cores: those it may run on over the ranks that share
    the host (``LOCAL_WORLD_SIZE``). Not ``torch.get_num_threads()``, which launchers set to 1
    per rank for the training's kernels while the cores would idle through initialisation."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def bands(global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[first, stop)`` ranges of global indices along the first dimension that split the box
    into pieces of about ``BAND_VALUES`` values, cut on the tile grid."""
    step = tile_shape(len(global_shape))[0]
    per_index = math.prod(shape[1:])
    step *= max(1, BAND_VALUES // max(1, per_index * step))
    cuts = range((offset[0] // step + 1) * step, offset[0] + shape[0], step)
    edges = [offset[0], *cuts, offset[0] + shape[0]]
    return list(itertools.pairwise(edges))


def draw_box_(
    values: torch.Tensor,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    kind: str,
    std: float,
    seed: int,
    name: str,
    threads: int,
) -> None:
    """Draw the box into ``values``, a float32 CPU tensor of its shape: tile by tile, each from a
    CPU generator of its own; the tiles are shared among up to ``threads`` threads (the draws
    release the GIL), which changes no value."""
    tile = tile_shape(len(global_shape))
    edge = math.erf(TRUNCATE_AT_STD / math.sqrt(2.0))
    grid = [range(o // t, (o + s - 1) // t + 1) for o, s, t in zip(offset, values.shape, tile)]
    indices = list(itertools.product(*grid))

    @torch.no_grad()  # grad mode is per thread: the caller's no_grad does not reach the pool's
    def draw(share: list[tuple[int, ...]]) -> None:
        gen = torch.Generator()
        for index in share:
            start = [i * t for i, t in zip(index, tile)]
            stop = [min(a + t, n) for a, t, n in zip(start, tile, global_shape)]
            block = torch.empty([b - a for a, b in zip(start, stop)], dtype=torch.float32)
            gen.manual_seed(tile_seed(seed, name, index))
            if kind == "normal":
                block.normal_(0.0, std, generator=gen)
            else:
                block.uniform_(-edge, edge, generator=gen)
            lo = [max(a, o) for a, o in zip(start, offset)]
            hi = [min(b, o + s) for b, o, s in zip(stop, offset, values.shape)]
            values[tuple(slice(low - o, high - o) for low, high, o in zip(lo, hi, offset))] = block[
                tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, start))
            ]

    threads = min(threads, len(indices) // MIN_TILES_PER_THREAD)
    if threads <= 1:
        draw(indices)
    else:
        share = -(-len(indices) // threads)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(draw, [indices[i : i + share] for i in range(0, len(indices), share)]))
    if kind == "trunc_normal":
        bound = TRUNCATE_AT_STD * std
        values.erfinv_().mul_(std * math.sqrt(2.0)).clamp_(-bound, bound)
