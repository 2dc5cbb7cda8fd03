"""The ``[float8]`` section: float8 training of the linear layers through torchao
(``parallelisms/float8.py``), named as torchtitan names it. It applies when `model.converters`
holds `float8`."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.fields import StrList, setting

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class Float8:
    recipe_name: str = setting(
        "tensorwise",
        "Scaling: `tensorwise` (one scale per tensor; fastest; the loss depends on the micro-batch size), "
        "`rowwise` (one scale per row) or `rowwise_with_gw_hp` (rowwise with the weight gradient in high "
        "precision). What each keeps of the same loss on every layout, per step and over a run (with "
        "`debug.layout_invariant`: the same bits): docs/float8.md.",
        FLOAT8_RECIPES,
    )
    enable_fsdp_float8_all_gather: bool = setting(
        False, "With `tensorwise` under FSDP: all-gather the weights in float8 (half the bytes; CUDA only)."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = setting(
        False,
        "With the float8 all-gather: compute every weight's scale in one all-reduce after the optimizer step.",
    )
    filter_fqns: StrList = setting(  # noqa: RUF009 - an immutable tuple
        StrList(),
        "Module names (or their endings, e.g. `attention.wk`) kept in high precision besides those never "
        "converted: the output layer, the MoE router and linears whose dimensions are not multiples of 16.",
    )
    moe_experts: bool = setting(
        False,
        "Also the MoE's routed experts, through torchao's float8 rowwise grouped matmul (H100/H200 only).",
    )
