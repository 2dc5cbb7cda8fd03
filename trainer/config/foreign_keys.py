"""Keys of other trainers (torchtitan, Megatron-LM, Hugging Face configs) that a user coming from
them would try, with what meshtrain does instead: a key naming a feature we do not have gets that
answer rather than the nearest spelling of an unrelated key.

Matched on the key's last part, in any section, dashes read as underscores.
"""

from __future__ import annotations

_DROPLESS = (
    "the MoE is dropless: every token reaches its top-k experts, none is dropped or padded, so there is "
    "no capacity to set (the busiest expert-parallel rank's extra tokens are planned with "
    "`--target.routing_imbalance`)"
)
_BALANCE_WEIGHT = "the balancing loss's weight is `moe.balance_loss_weight` (`E x sum_i f_i P_i` per MoE layer)"
_BIAS_RATE = "the aux-loss-free routing bias (DeepSeek-V3) moves by `moe.bias_update_rate` each step"
_EXPERT_SHAPE = (
    "the number of experts, top-k and expert width are the model's: choose them with `model.flavor` "
    "(debugmoe: 8 experts, top-2; qwen3_30b_a3b and qwen3_235b_a22b: 128, top-8)"
)
_EXPERT_TP = (
    "experts are not split by tensor parallelism: under `parallelism.tensor_parallel_degree` each TP rank "
    "routes its own sequence shard, and the experts are split over `parallelism.expert_parallel_degree` ranks "
    "and sharded by FSDP"
)

FOREIGN_KEYS: dict[str, str] = {
    "capacity_factor": _DROPLESS,
    "moe_expert_capacity_factor": _DROPLESS,
    "expert_capacity": _DROPLESS,
    "moe_token_drop_policy": _DROPLESS,
    "drop_tokens": _DROPLESS,
    "aux_loss_coeff": _BALANCE_WEIGHT,
    "moe_aux_loss_coeff": _BALANCE_WEIGHT,
    "router_aux_loss_coef": _BALANCE_WEIGHT,
    "aux_loss_alpha": _BALANCE_WEIGHT,
    "moe_router_load_balancing_type": "the balancing loss's scope is `moe.balance_loss_scope` "
    "(global_batch, sequence or micro_batch) and its weight `moe.balance_loss_weight`",
    "load_balance_coeff": _BIAS_RATE,
    "moe_router_bias_update_rate": _BIAS_RATE,
    "bias_update_speed": _BIAS_RATE,
    "router_z_loss_coef": "there is no router z-loss; the router is balanced by `moe.balance_loss_weight` "
    "and `moe.bias_update_rate`",
    "moe_z_loss_coeff": "there is no router z-loss; the router is balanced by `moe.balance_loss_weight` "
    "and `moe.bias_update_rate`",
    "num_experts": _EXPERT_SHAPE,
    "n_routed_experts": _EXPERT_SHAPE,
    "moe_num_experts": _EXPERT_SHAPE,
    "num_experts_per_tok": _EXPERT_SHAPE,
    "top_k": _EXPERT_SHAPE,
    "topk": _EXPERT_SHAPE,
    "moe_router_topk": _EXPERT_SHAPE,
    "expert_tensor_parallel_degree": _EXPERT_TP,
    "expert_tensor_parallel_size": _EXPERT_TP,
    "expert_model_parallel_size": "expert parallelism is `parallelism.expert_parallel_degree` (or `--mesh ep=N`)",
}
"""Another trainer's key -> what meshtrain does instead, said in the unknown-key error."""


def instead_of(key: str) -> str | None:
    """What we do instead of the feature ``key`` (``section.name`` or a bare name) names, or None."""
    return FOREIGN_KEYS.get(key.rsplit(".", 1)[-1].replace("-", "_").lower())
