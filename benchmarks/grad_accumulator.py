"""Cost of the accumulator's finalize against plain clipping and the two-pass way.

(a) ``finalize``: DTensor-aware total norm + one fused in-place scale by ``clip_coef / N``;
(b) ``clip_grad_norm_`` alone (the floor: a norm and a scale are unavoidable);
(c) two passes: scale every gradient by ``1 / N``, then ``clip_grad_norm_``.

One process, ~200M float32 parameters shaped like a Llama block stack. Gradients are restored
from a copy before every timed call (outside the timing), so each call sees the same values.
Prints one JSON line with the medians in milliseconds.

    python benchmarks/grad_accumulator.py [--params-millions 200] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from parallelisms.torch_private import kernels
from trainer.loss import IGNORE_INDEX
from trainer.step.batches import MicroBatch
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.grad_sync import GradSync
from trainer.step.part import StepResult
from trainer.step.sums import StepSums

N_VALID_TOKENS = 3_000


def make_model(params_millions: int, dim: int = 2048) -> nn.ParameterList:
    """Blocks of four dim x dim matrices and three dim x 4dim ones, until the budget is met."""
    shapes, total = [], 0
    while total < params_millions * 1_000_000:
        for shape in [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (4 * dim, dim)] + [(dim,)] * 2:
            shapes.append(shape)
            total += torch.Size(shape).numel()
    model = nn.ParameterList(nn.Parameter(torch.empty(s)) for s in shapes)
    gen = torch.Generator().manual_seed(0)
    for p in model:
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def timed(fn, restore, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        restore()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    model = make_model(args.params_millions)
    params = list(model)
    grads = [p.grad for p in params]
    backup = [g.clone() for g in grads]
    max_norm = 1.0
    labels = torch.full((N_VALID_TOKENS * 2,), IGNORE_INDEX)
    labels[:N_VALID_TOKENS] = 0
    sums = StepSums.alone()
    accumulator = GradAccumulator(sums, GradSync(model, sums, microbatches=1), microbatches=1, max_norm=max_norm)

    def restore() -> None:
        kernels.foreach_copy_(grads, backup)

    def finalize() -> None:
        accumulator.begin([MicroBatch(labels, labels, None, None)])
        accumulator.after_backward(0, torch.tensor(1.0))
        accumulator.finish(StepResult())

    def clip_only() -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def two_pass() -> None:
        kernels.foreach_mul_(grads, 1.0 / N_VALID_TOKENS)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    for fn in (finalize, clip_only, two_pass):  # warm-up: page in, allocate
        restore()
        fn()
    # Interleave the three so drift in machine load hits them equally.
    results: dict[str, list[float]] = {"finalize_ms": [], "clip_only_ms": [], "two_pass_ms": []}
    for _ in range(args.repeats):
        for key, fn in zip(results, (finalize, clip_only, two_pass)):
            results[key].append(timed(fn, restore, 1))
    medians = {k: round(statistics.median(v), 2) for k, v in results.items()}
    medians["params"] = sum(p.numel() for p in params)
    medians["finalize_over_clip"] = round(medians["finalize_ms"] / medians["clip_only_ms"], 3)
    medians["two_pass_over_finalize"] = round(medians["two_pass_ms"] / medians["finalize_ms"], 3)
    medians["threads"] = torch.get_num_threads()
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
