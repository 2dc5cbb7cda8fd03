"""The shapes float8's GPU kernel takes, checked before a job starts: on CUDA ``torch._scaled_mm``
needs the first operand's contracted dimension and both dimensions of the second in multiples of
16 (a CPU's emulated matmuls need none of it, so a rehearsal there passes what the GPU refuses).

A float8 linear of a micro-batch's ``T`` tokens multiplies ``T x in`` by ``in x out`` for its
output, ``T x out`` by ``out x in`` for the input's gradient, and, with ``tensorwise`` and
``rowwise``, ``out x T`` by ``T x in`` for the weight's gradient: there the tokens are contracted,
so they must be a multiple of 16 too (``rowwise_with_gw_hp`` keeps that matmul in high
precision). Under tensor parallelism each rank multiplies its shard of the weight: a column-wise
linear its ``out / tp`` outputs, a row-wise one its ``in / tp`` inputs; a Mixture-of-Experts
feed-forward runs unsplit on its rank's ``T / tp`` tokens.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallelisms.float8 import KERNEL_MULTIPLE, Float8Settings, convertible
from parallelisms.model_parts import blocks, is_moe
from parallelisms.parallel_dims import ParallelismError
from parallelisms.tensor_parallel import block_plan

FLOAT8_WEIGHT_GRADIENT = ("tensorwise", "rowwise")
"""The recipes whose weight gradient is a float8 matmul over the tokens."""


def check_kernel_shapes(model: nn.Module, settings: Float8Settings, tokens: int, tp: int, tokens_are: str) -> None:
    """Raise :class:`ParallelismError` for the first converted linear of ``model`` (whole, on the
    meta device) whose float8 matmuls a GPU cannot run: ``tokens`` per micro-batch on a rank (its
    sequence shard under context parallelism), which ``tokens_are`` names (a template: ``{seq_len}
    x ...``), over ``tp`` tensor-parallel ranks. Emulated float8 (a CPU) takes any shape."""
    if settings.emulate:
        return
    for block_name, block in blocks(model).items():
        moe = is_moe(block.get_submodule("feed_forward"))
        plan = block_plan(block)
        for name, module in block.named_modules():
            fqn = f"layers.{block_name}.{name}"
            if not convertible(fqn, module, settings.filter_fqns):
                continue
            assert isinstance(module, nn.Linear)  # convertible takes nn.Linear only
            inputs, outputs, style = module.in_features, module.out_features, plan.get(name)
            if isinstance(style, ColwiseParallel):
                outputs //= tp
            elif isinstance(style, RowwiseParallel):
                inputs //= tp
            if inputs % KERNEL_MULTIPLE or outputs % KERNEL_MULTIPLE:
                raise ParallelismError(
                    f"{{tp}} = {tp} leaves each rank a {outputs} x {inputs} shard of {fqn}'s weight, and "
                    f"torch._scaled_mm on a GPU takes only multiples of {KERNEL_MULTIPLE}: use a tp that keeps "
                    f"them multiples of {KERNEL_MULTIPLE}, or keep the layer in high precision with "
                    f"{{float8_filter}} = ['{'.'.join(fqn.split('.')[-2:])}']."
                )
            rows = tokens // tp if moe and name.startswith("feed_forward.") else tokens
            if settings.recipe in FLOAT8_WEIGHT_GRADIENT and rows % KERNEL_MULTIPLE:
                where = f" ({tokens_are}{f' / {{tp}} = {tp}, the MoE layer' if rows != tokens else ''})"
                raise ParallelismError(
                    f"a micro-batch holds {rows} tokens on a rank{where}: {fqn}'s weight gradient, with "
                    f"{{float8_recipe}} = {settings.recipe!r} a float8 matmul over those tokens, needs them in "
                    f"multiples of {KERNEL_MULTIPLE} on a GPU (torch._scaled_mm); make the micro-batch's tokens a "
                    f"multiple of {KERNEL_MULTIPLE}, or use {{float8_recipe}} = 'rowwise_with_gw_hp' (that "
                    "gradient in high precision)."
                )
