"""What drawing the initial weights on the CPU costs a rank: the 8B preset's initialisation time
per rank, with the values drawn on the CPU (``tiled_init``, one model per seed on every device)
and, where CUDA is present, drawn on the GPU by its own generator (the algorithm it replaced,
kept here as the baseline: other weights on a GPU than on the CPU for the same seed).

The whole model would not fit this benchmark's memory, so each distinct parameter (shape and
initialisation: the embedding, the output, one block's matrices, an MoE block's stacked experts)
is initialised once at a rank's box under FSDP over ``--worlds`` ranks (rows cut as
``torch.chunk`` cuts them, rank 0's box), at most ``--sample`` values of it (whole tile rows;
the time scaled by the box's size, as the draws cost the same per value), and the times are
summed over the model's parameters. Targets:

- ``cpu``: a float32 parameter in CPU memory, drawn in place (the CPU trainer);
- ``cpu_bf16``: a bfloat16 parameter in CPU memory, which receives float32 bands as a GPU
  parameter does (the band path's cost without a GPU);
- ``cuda``: a float32 parameter on the GPU, receiving the CPU's draws in bands (only with CUDA);
- ``cuda_drawn_on_gpu``: the replaced algorithm, drawn on the GPU (only with CUDA).

Each at ``--threads`` (the tiles are shared among that many threads; a rank of the trainer uses
its share of the host's cores, ``tiled_init.draw_threads``). ``_cpu`` figures are the process's
CPU time, which other processes on a shared machine do not inflate as they do the wall time.
Prints one JSON line per flavor, world size and thread count, seconds per target.

    python benchmarks/init_device.py [--flavor 8B] [--layers 0] [--worlds 1 8] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.model import moe
from trainer.model.llama3 import FLAVORS, ModelArgs, whole_model
from trainer.model.tiled_init import TILE, TRUNCATE_AT_STD, fill_local_, tile_seed, tile_shape


@torch.no_grad()
def fill_on_device_(local: torch.Tensor, global_shape: tuple[int, ...], kind: str, std: float, name: str) -> None:
    """The replaced algorithm (rank 0's box, at offset 0): each tile from a generator on the
    parameter's device, ``erfinv`` there too."""
    gen = torch.Generator(device=local.device)
    tile = tile_shape(len(global_shape))
    edge = math.erf(TRUNCATE_AT_STD / math.sqrt(2.0))
    grid = [range((s - 1) // t + 1) for s, t in zip(local.shape, tile)]
    for index in itertools.product(*grid):
        start = [i * t for i, t in zip(index, tile)]
        stop = [min(a + t, n) for a, t, n in zip(start, tile, global_shape)]
        block = torch.empty([b - a for a, b in zip(start, stop)], device=local.device)
        gen.manual_seed(tile_seed(0, name, index))
        if kind == "normal":
            block.normal_(0.0, std, generator=gen)
        else:
            block.uniform_(-edge, edge, generator=gen)
        hi = [min(b, s) for b, s in zip(stop, local.shape)]
        local[tuple(slice(a, h) for a, h in zip(start, hi))] = block[tuple(slice(0, h - a) for a, h in zip(start, hi))]
    if kind == "trunc_normal":
        local.erfinv_().mul_(std * math.sqrt(2.0)).clamp_(-TRUNCATE_AT_STD * std, TRUNCATE_AT_STD * std)


def parameter_groups(args: ModelArgs) -> Counter[tuple[str, tuple[int, ...], str, float]]:
    """``(first name, global shape, kind, std) -> count`` over the model's randomly drawn parameters."""
    model = whole_model(args)
    groups: Counter[tuple[str, tuple[int, ...], str, float]] = Counter()
    first: dict[tuple[tuple[int, ...], str], str] = {}
    for name, param in model.named_parameters():
        kind, std = model.init_std(name)
        if kind == "ones":
            continue
        key = (tuple(param.shape), kind)
        groups[(first.setdefault(key, name), *key, std)] += 1
    return groups


def timed(
    target: str, name: str, shape: tuple[int, ...], rows: int, kind: str, std: float, threads: int
) -> tuple[float, float]:
    """Wall and process CPU seconds to fill a ``rows``-row box at offset 0 of a ``shape``
    parameter on ``target``."""
    device = "cuda" if target.startswith("cuda") else "cpu"
    dtype = torch.bfloat16 if target == "cpu_bf16" else torch.float32
    local = torch.empty((rows, *shape[1:]), dtype=dtype, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    if target == "cuda_drawn_on_gpu":
        fill_on_device_(local, shape, kind, std, name)
    else:
        fill_local_(local, shape, (0,) * len(shape), kind, std, 0, name, threads)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - start_cpu


def measure(args: ModelArgs, world: int, sample: int, targets: list[str], threads: int) -> dict[str, float]:
    """Rank 0's initialisation seconds per target (wall, and ``_cpu``: the process's CPU time,
    which other processes on a shared machine do not inflate), and the values it draws."""
    seconds = {key: 0.0 for target in targets for key in (target, target + "_cpu")}
    values = 0
    for (name, shape, kind, std), count in parameter_groups(args).items():
        rows = -(-shape[0] // world)
        per_row = math.prod(shape[1:])
        step = tile_shape(len(shape))[0]
        measured = min(rows, max(step, sample // per_row // step * step))
        values += count * rows * per_row
        for target in targets:
            wall, cpu = timed(target, name, shape, measured, kind, std, threads)
            seconds[target] += count * wall * rows / measured
            seconds[target + "_cpu"] += count * cpu * rows / measured
    return {"values_per_rank": values, **{f"{t}_s": round(s, 2) for t, s in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B", help="a Llama 3 or MoE flavor")
    parser.add_argument("--layers", type=int, default=0, help="blocks (0: the flavor's)")
    parser.add_argument("--worlds", nargs="*", type=int, default=[1, 8], help="FSDP ranks sharing the model")
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2], help="threads drawing the tiles")
    parser.add_argument("--sample", type=int, default=1 << 26, help="most values timed per parameter")
    options = parser.parse_args()
    flavors = {**FLAVORS, **moe.FLAVORS}
    args = flavors[options.flavor]
    if options.layers:
        args = replace(args, n_layers=options.layers)
    targets = ["cpu", "cpu_bf16"] + (["cuda", "cuda_drawn_on_gpu"] if torch.cuda.is_available() else [])
    timed("cpu", "warm-up", TILE, TILE[0], "trunc_normal", 0.02, 1)
    for world, threads in itertools.product(options.worlds, options.threads):
        row = {"flavor": options.flavor, "layers": args.n_layers, "world": world, "threads": threads}
        print(json.dumps(row | measure(args, world, options.sample, targets, threads)), flush=True)


if __name__ == "__main__":
    main()
