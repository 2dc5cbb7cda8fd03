"""The ``[parallelism]`` section: the mesh's degrees and how each parallelism is applied.

A section of its own, for its size: ``schema.py`` holds the others and the whole ``JobConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.choices import CONTEXT_PARALLEL_BACKENDS, PIPELINE_SCHEDULES
from trainer.config.fields import setting
from trainer.config.limits import MAX_OVERLAP_CHUNKS


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = setting(
        1, "HSDP replicas: full model copies, each sharded over `data_parallel_shard_degree` ranks."
    )
    data_parallel_shard_degree: int = setting(
        -1, "FSDP shard degree; -1 infers it as world size / (pp x replicate x tp x cp)."
    )
    tensor_parallel_degree: int = setting(
        1,
        "Tensor-parallel degree: attention heads, feed-forward units and the vocabulary are split "
        "over this many ranks, which see the same tokens (sequence parallel between blocks).",
    )
    context_parallel_degree: int = setting(
        1,
        "Context-parallel degree: each sequence is split over this many ranks (head-tail load "
        "balanced), which also shard the parameters together with dp_shard.",
    )
    expert_parallel_degree: int = setting(
        1,
        "Expert-parallel degree (`moe` models): the routed experts are split over this many of the "
        "`data_parallel_shard_degree` x `context_parallel_degree` ranks, which exchange tokens all-to-all; "
        "must divide that product.",
    )
    expert_parallel_overlap_chunks: int = setting(
        2,
        "With `expert_parallel_degree` > 1: each MoE layer exchanges its tokens in this many chunks, so "
        "that one chunk's all-to-alls run while the experts compute another, forward and backward; 1 "
        "exchanges all at once (fewer, larger matmuls, every exchange exposed). The result does not "
        "depend on it.",
        ge=1,
        le=MAX_OVERLAP_CHUNKS,
    )
    context_parallel_backend: str = setting(
        "auto",
        "Attention across context-parallel shards: `ring` (PyTorch's ring attention, CUDA only), "
        "`allgather_kv` (all-gather keys and values, any device), `ulysses` (all-to-all to whole "
        "sequences of heads / cp heads, any device; cp x tp must divide the heads), or `auto` "
        "(ring on CUDA, allgather_kv elsewhere or with `training.document_mask`).",
        ("auto", *CONTEXT_PARALLEL_BACKENDS),
    )
    context_parallel_rotate_method: str = setting(
        "allgather",
        "How the ring backend moves key/value shards between ranks.",
        ("allgather", "alltoall"),
    )
    pipeline_parallel_degree: int = setting(
        1,
        "Pipeline-parallel degree (the outermost mesh dimension): the layers are split into "
        "stages over this many ranks, embedding on the first, norm + output + loss on the last.",
    )
    pipeline_parallel_schedule: str = setting(
        "1F1B",
        "Pipeline schedule: `GPipe` and `1F1B` run one stage per rank; `Interleaved1F1B`, "
        "`InterleavedZeroBubble` (looped) and `ZBVZeroBubble` (V-shaped, exactly 2) run several.",
        PIPELINE_SCHEDULES,
    )
    pipeline_parallel_microbatch_size: int = setting(
        1,
        "Sequences per pipeline micro-batch: a data-parallel rank's share of the global batch "
        "(global / data-parallel degree) is cut into micro-batches of this size, all run by one "
        "schedule step.",
        ge=1,
    )
    pipeline_parallel_layers_per_stage: int = setting(
        -1,
        "Stage units per stage (blocks, with the embedding and the output counted as the "
        "less-layers below); the number of stages is the model's units divided by this, which "
        "must be exact. -1: pp stages (2 x pp for multi-stage schedules), split as evenly as "
        "possible.",
        ge=1,
        allowed=(-1,),
    )
    pipeline_parallel_first_stage_less_layers: int = setting(
        1, "Blocks fewer on the first stage, which also runs the token embedding.", ge=0
    )
    pipeline_parallel_last_stage_less_layers: int = setting(
        1, "Blocks fewer on the last stage, which also runs the norm, the output projection and the loss.", ge=0
    )
    fsdp_reshard_after_forward: str = setting(
        "default",
        "Free gathered parameters after forward: `always`, `never` (faster backward, more "
        "memory), or `default` (every block but the last one, whose backward runs at once; with one "
        "data-parallel rank and no TP, CP or PP, keep every block gathered and the gradients "
        "unsharded for the whole step, cast and reduced once a step instead of per micro-batch; "
        "likewise the routed experts when `ep` equals the data-parallel shard x CP ranks without "
        "TP, HSDP or PP, as each expert then lives on one rank).",
        ("default", "always", "never"),
    )
    disable_loss_parallel: bool = setting(
        False, "With tensor parallelism, gather the logits instead of a vocabulary-parallel loss."
    )
    enable_async_tensor_parallel: bool = setting(
        False,
        "Overlap tensor-parallel communication with the matmuls (CUDA only; needs "
        "`compile.enable`, since async TP is a torch.compile graph rewrite).",
    )
