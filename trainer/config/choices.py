"""The values the config's choice fields offer, declared here so that the config loads anywhere
(``--help``, a tool reading a config) without the layers that implement them: the data stack,
torch, the parallelisms. Each implementing layer has a test that it covers its list exactly
(``tests/test_config.py``)."""

from __future__ import annotations

DATASET_KINDS = ("shakespeare", "shakespeare_dialogue", "chat")
"""The values ``training.dataset`` accepts: the sample builders of ``trainer/data/samples.py``."""

PACKED_DATASET_KINDS = ("shakespeare",)
"""The kinds whose samples hold several documents (``training.document_mask`` applies)."""

CONTEXT_PARALLEL_BACKENDS = ("allgather_kv", "ring", "ulysses")
"""What ``parallelism.context_parallel_backend`` may name, besides ``auto``
(``parallelisms/context_parallel.py``)."""

PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""What ``parallelism.pipeline_parallel_schedule`` may name (``parallelisms/pipeline_split.py``)."""

TARGET_GPUS = ("h100", "h200", "a100", "b200")
"""What ``machine.gpu`` may name besides nothing: the GPUs of the hardware table (``trainer/hardware.py``)."""

MODEL_FLAVORS = {
    "llama3": ("debugmodel", "1B", "3B", "8B", "70B", "405B"),
    "qwen3": ("qwen3_debug", "0.6B", "1.7B", "4B", "8B", "14B", "32B"),
    "moe": ("debugmoe", "qwen3_moe_debug", "qwen3_30b_a3b", "qwen3_235b_a22b"),
    "deepseek_v3": ("deepseek_v3_debug", "16B", "671B"),
}
"""Each ``model.name``'s ``model.flavor`` presets (``trainer/model/families.py``)."""

MOE_FAMILIES = ("moe", "deepseek_v3")
"""The ``model.name`` values whose models route tokens to experts (the ``[moe]`` section applies)."""

BALANCE_SCOPES = ("global_batch", "sequence", "micro_batch")
"""What ``moe.balance_loss_scope`` may name (``trainer/model/moe.py``)."""

BALANCE_LAYERS = ("per_layer", "pooled")
"""What ``moe.balance_loss_layers`` may name (``trainer/step/expert_balance.py``)."""

HELD_FORWARDS = ("auto", "device", "host", "prepass")
"""What ``moe.held_forwards`` may name (``trainer/planning/held_for_speed.py``)."""
