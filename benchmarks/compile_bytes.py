"""What compile's kernels move against what the simulator charges (docs/performance.md).

Compiles one float8 (or bf16) linear of the Llama 3 8B shape (``w1``, 4096 -> 14336), or one
whole 8B block, with Inductor on this CPU, runs a forward and backward, and reads Inductor's
own count of each kernel's bytes (its ``inductor_metrics`` log). Beside it, the same module runs
eagerly under the simulator's cost recorder, which charges each op as compile's fusion would
(``trainer/simulation/fusion.py``). Matmuls are left out of both (the simulator times them by
their FLOPs). Both grow linearly with the tokens: measured at 256 and 512 tokens, printed per
token at one 8192-token sequence, with ``--kernels`` each Inductor kernel's share. On a GPU,
``--device cuda`` counts the Triton kernels the simulator's fusion model stands for.

    python benchmarks/compile_bytes.py [--module linear|block] [--recipes none,tensorwise,rowwise]
        [--device cpu|cuda] [--kernels]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # a cached graph logs no metrics
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ["TORCH_LOGS"] = "inductor_metrics"  # Inductor counts each kernel's bytes only with this log on
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from trainer.model.llama3 import FLAVORS, TransformerBlock, rope_frequencies
from trainer.simulation.cost_model import CostRecorder
from trainer.simulation.memory_tracker import MemoryTracker

TOKENS = (256, 512)
AT = 8192


def build(module: str, recipe: str, tokens: int, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    args = FLAVORS["8B"]
    if module == "linear":
        model: nn.Module = nn.Sequential(nn.Linear(args.dim, args.ffn_hidden_dim, bias=False))
        inputs: tuple[torch.Tensor, ...] = (torch.randn(tokens, args.dim),)
    else:
        model = TransformerBlock(0, args)
        inputs = (torch.randn(1, tokens, args.dim), rope_frequencies(args)[:tokens])
    model = model.to(device, torch.bfloat16)
    inputs = tuple(t.to(device) for t in inputs)
    if recipe != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    first = inputs[0].to(torch.bfloat16).requires_grad_()
    return model, (first, *inputs[1:])


def run(
    model: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], recorder: CostRecorder | None = None
) -> None:
    out = model(*inputs)
    if recorder is not None:
        recorder.enabled = False  # the incoming gradient is made outside the compiled module
    gradient = torch.ones_like(out)
    if recorder is not None:
        recorder.enabled = True
    out.backward(gradient)


def inductor(module: str, recipe: str, tokens: int, device: str) -> list[tuple[str, str, int]]:
    """(kernel, what it fuses, bytes) of every kernel but the matmuls, forward and backward."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    model, inputs = build(module, recipe, tokens, device)
    metrics.reset()
    run(torch.compile(model), inputs)
    kernels = []
    for node, elements in metrics.nodes_num_elem:
        if type(node).__name__ == "ExternKernelSchedulerNode":
            continue
        origins = sorted({o.name for n in node.get_nodes() for o in getattr(n.node, "origins", ())})
        kernels.append((node.get_name(), " ".join(origins), 4 * elements))  # the log counts 4-byte words
    return kernels


def simulated(module: str, recipe: str, tokens: int) -> int:
    """The simulator's memory traffic for the same forward and backward, as if compiled."""
    model, inputs = build(module, recipe, tokens)
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.where = lambda: (module, True)
    with MemoryTracker([recorder]):
        run(model, inputs, recorder)
    return recorder.cost.fused_bytes


def per_token(low: float, high: float) -> float:
    """Bytes at ``AT`` tokens per token, from the two measured token counts."""
    slope = (high - low) / (TOKENS[1] - TOKENS[0])
    return (low + slope * (AT - TOKENS[0])) / AT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", choices=("linear", "block"), default="linear")
    parser.add_argument("--recipes", default="none,tensorwise,rowwise")
    parser.add_argument("--device", default="cpu", help="where Inductor compiles (cuda: its Triton kernels)")
    parser.add_argument("--kernels", action="store_true", help="print each kernel's bytes per token")
    options = parser.parse_args()
    metrics_log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # on for its counts, kept quiet
    metrics_log.addFilter(lambda record: False)
    for recipe in options.recipes.split(","):
        measured = [inductor(options.module, recipe, t, options.device) for t in TOKENS]
        charged = [simulated(options.module, recipe, t) for t in TOKENS]
        row = {
            "module": options.module,
            "recipe": recipe,
            "device": options.device,
            "inductor_kernels": len(measured[0]),
            "inductor_bytes_per_token": round(per_token(*(sum(k[2] for k in m) for m in measured))),
            "simulated_bytes_per_token": round(per_token(*charged)),
        }
        print(json.dumps(row), flush=True)
        if options.kernels:
            for (name, fuses, low), (_, _, high) in zip(*measured, strict=True):
                print(f"  {name:24s} {per_token(low, high):9.0f} B/token  {fuses[:100]}")


if __name__ == "__main__":
    main()
