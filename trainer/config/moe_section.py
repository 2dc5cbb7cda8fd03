"""The ``[moe]`` section: how a Mixture-of-Experts model is kept balanced (``trainer/step/expert_balance.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.choices import BALANCE_LAYERS, BALANCE_SCOPES, HELD_FORWARDS
from trainer.config.fields import setting
from trainer.config.limits import MAX_BALANCE_LOSS_WEIGHT, MAX_BIAS_UPDATE_RATE


@dataclass
class MoE:
    bias_update_rate: float = setting(
        0.001,
        "Aux-loss-free balancing (DeepSeek-V3): at each step every expert's routing bias moves by "
        "this much towards the mean load, from the step's global tokens per expert; 0 turns it off. The router's "
        "scores lie in [0, 1]: above 0.1 the biases, not the router, choose the experts (warned).",
        ge=0.0,
        le=MAX_BIAS_UPDATE_RATE,
    )
    balance_loss_weight: float = setting(
        0.0,
        "Weight of the load-balancing loss `E x sum_i f_i P_i` per MoE layer; 0 turns it off. The loss is 1 per "
        "layer when balanced, the language model's about 2 to 10: above 1 balance outweighs language (warned).",
        ge=0.0,
        le=MAX_BALANCE_LOSS_WEIGHT,
    )
    balance_loss_scope: str = setting(
        "global_batch",
        "Where the expert frequencies `f` of the balancing loss are counted: `global_batch` (the whole step, "
        "the same on every mesh: under full activation checkpointing by the step's own forwards, all run before "
        "its backwards, else by a forward-only counting pre-pass), `sequence` (whole sequences: not with "
        "context or tensor parallelism, which split them) or `micro_batch` (per rank-local micro-batch, "
        "under CP or TP its sequence shard, as most frameworks do; depends on the mesh).",
        BALANCE_SCOPES,
    )
    balance_loss_layers: str = setting(
        "per_layer",
        "How the balancing loss treats the MoE layers: `per_layer` (one loss per layer; the weight applies to each, "
        "the log shows their mean) or `pooled` (transformers' `output_router_logits` aux loss: one loss over every "
        "layer's tokens together, `f` summing to top-k; needs the `global_batch` scope).",
        BALANCE_LAYERS,
    )
    held_forwards: str = setting(
        "auto",
        "Where the `global_batch` scope's counts come from under full activation checkpointing: the step's own "
        "forwards, held until its backwards on the `device` or in pinned `host` memory (copied on a stream of "
        "their own; on a CPU only a copy), or a forward-only `prepass`. `auto`: the device where the memory "
        "plan has room for every micro-batch's block inputs, else host memory on a GPU, else the pre-pass.",
        HELD_FORWARDS,
    )
