"""Start-up time of a sharded model: tile-seeded initialisation against drawing full tensors.

For 1 and 4 CPU processes (gloo, FSDP over all of them, as training shards), each process
builds the ~1B-parameter model on the meta device, shards it, materialises its shards and
initialises them, then runs one forward and backward pass on 16 tokens. Two ways to initialise:

- before: the algorithm that ``init_weights`` replaced, kept here as the baseline: every rank
  draws every parameter's *full* tensor (``nn.init`` from a generator seeded per parameter) and
  keeps its slice, so each rank does the work of the whole model;
- after: ``Transformer.init_weights``, which draws only the tiles a rank's shards overlap.

Times are the slowest rank's: ``init_s`` the initialisation alone, ``first_step_s`` from the
meta-device build to the end of the first backward (process start-up and the process group are
left out; no optimizer step, whose AdamW state would not fit this machine in one process).
``drawn_per_rank`` is the most random values any rank draws. Prints one JSON line per process
count with both algorithms and their ratios.

The model is Llama-3.2-1B's blocks with a 2048-token vocabulary (``--vocab 128256`` for the
real one; fp32 weights are ~4 GB per full copy, and the 1-process forward and backward add the
same again for gradients). Each process gets ``cores / processes`` threads.

    python benchmarks/startup.py [--worlds 1 4] [--vocab 2048] [--flavor 1B]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelisms.fsdp import apply_fsdp
from parallelisms.parallel_dims import ParallelDims
from trainer.loss import cross_entropy_sum
from trainer.model.llama3 import FLAVORS, Transformer, num_params, rope_frequencies
from trainer.model.tiled_init import local_slice
from trainer.runtime.distributed import init_distributed

ALGORITHMS = ("before", "after")


@torch.no_grad()
def init_full_then_slice(model: Transformer, seed: int) -> None:
    """The replaced algorithm: each parameter's full tensor from its own generator, then the slice."""
    for name, param in model.named_parameters():
        kind, std = model.init_std(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        if kind == "ones":
            local.fill_(1.0)
            continue
        gen = torch.Generator(device=local.device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        if kind == "normal":
            nn.init.normal_(full, 0.0, std, generator=gen)
        else:
            nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=gen)
        local.copy_(local_slice(full, param))
    model.freqs_cis = rope_frequencies(model.args, device=model.freqs_cis.device)


class DrawCounter:
    """Counts the values ``Tensor.normal_`` and ``Tensor.uniform_`` fill (all of both algorithms' draws)."""

    def __init__(self) -> None:
        self.values = 0
        self.originals = {name: getattr(torch.Tensor, name) for name in ("normal_", "uniform_")}

    def __enter__(self) -> DrawCounter:
        for name, method in self.originals.items():
            setattr(torch.Tensor, name, self._counted(method))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, method in self.originals.items():
            setattr(torch.Tensor, name, method)

    def _counted(self, method):
        def draw(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.values += tensor.numel()
            return method(tensor, *args, **kwargs)

        return draw


def rank_run(algorithm: str, flavor: str, vocab: int) -> dict[str, float]:
    """One rank: build, shard, materialise, initialise (timed), one forward and backward."""
    world = dist.get_world_size()
    mesh = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, world_size=world).build_mesh("cpu").fsdp
    dist.barrier()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(replace(FLAVORS[flavor], vocab_size=vocab, max_seq_len=128))
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward="default")
    model.to_empty(device="cpu")
    init_start = time.perf_counter()
    with DrawCounter() as drawn:
        if algorithm == "before":
            init_full_then_slice(model, 0)
        else:
            model.init_weights(0)
    init_s = time.perf_counter() - init_start
    tokens = torch.randint(0, vocab, (1, 17), generator=torch.Generator().manual_seed(0))
    cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {
        "init_s": init_s,
        "first_step_s": time.perf_counter() - start,
        "drawn": drawn.values,
        "params": num_params(model),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, out_dir: str, algorithm: str, flavor: str, vocab: int, threads: int
) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(threads)
    init_distributed("cpu", timeout_s=1800)
    result = rank_run(algorithm, flavor, vocab)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, algorithm: str, flavor: str, vocab: int) -> dict[str, float]:
    """The slowest rank's times and the largest draw count of ``world`` processes."""
    threads = max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry,
            args=(world, _free_port(), out_dir, algorithm, flavor, vocab, threads),
            nprocs=world,
            start_method="spawn",
        )
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    return {key: max(r[key] for r in ranks) for key in ranks[0]} | {"threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="*", type=int, default=[1, 4])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--flavor", default="1B", choices=["debugmodel", "1B"])
    args = parser.parse_args()
    for world in args.worlds:
        runs = {algorithm: measure(world, algorithm, args.flavor, args.vocab) for algorithm in ALGORITHMS}
        before, after = runs["before"], runs["after"]
        print(
            json.dumps(
                {
                    "model": args.flavor,
                    "vocab": args.vocab,
                    "params": after["params"],
                    "processes": world,
                    "threads_per_process": after["threads"],
                    "before_init_s": round(before["init_s"], 2),
                    "after_init_s": round(after["init_s"], 2),
                    "init_speedup": round(before["init_s"] / after["init_s"], 2),
                    "before_first_step_s": round(before["first_step_s"], 2),
                    "after_first_step_s": round(after["first_step_s"], 2),
                    "first_step_speedup": round(before["first_step_s"] / after["first_step_s"], 2),
                    "before_drawn_per_rank": before["drawn"],
                    "after_drawn_per_rank": after["drawn"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
