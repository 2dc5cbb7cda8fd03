"""The device check's throughput jobs, in their order of value, and the shapes they run at: full
size on a GPU, tiny when rehearsing on the CPU.

The order is what a budget cut spares: this round measures the Mixture-of-Experts model first
(the Qwen3-30B-A3B shape at the most blocks one GPU holds, at the preset's per-GPU work, each
balancing scope eager and compiled: :func:`moe_work_jobs`), then one row per newer family (the
DeepSeek-V3 16B and Qwen3-8B shapes at fewer blocks: :func:`family_jobs`), then the dense models
eager; the dense compiled jobs and the unchunked loss come after the attention and resume rows,
where a slow run can only cost themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EIGHT_B_LAYERS = (8, 6, 4, 2)
"""The 8B shape keeps its width with the first of these block counts that the memory estimate fits."""
MOE_LAYERS = (8, 6, 5, 4, 3, 2, 1)
"""The same for the Qwen3-30B-A3B shape, whose 128 experts make a block 0.6 B parameters (10 GB of
float32 weights, gradients and AdamW moments): an 80 GB H100 holds 4."""
FAMILY_LAYERS = (8, 6, 5, 4, 3, 2)
"""The DeepSeek-V3 16B and Qwen3-8B shapes keep their widths with the first of these block counts
that the memory estimate fits (a 16B block holds 64 experts: 0.55 B parameters, 8.9 GB of state)."""
FAMILY = "newer family: "
"""Where the family rows' settings begin: ``--only "newer family"`` runs them alone."""
FIT_FRACTION = 0.9
MOE_WORK = ["--training.local_batch_size", "1", "--training.global_batch_size", "8"]
"""The MoE preset's per-GPU work: 8 micro-batches of one sequence a step (its 64 sequences over 8 GPUs)."""
MOE_WORK_STEPS = 6
"""Steps of each MoE work job: the warm-up and 3 measured, each of 8 sequences."""
BALANCE_SCOPES = ("global_batch", "micro_batch")
FIRST_JOBS = 4
"""Jobs measured before the attention and resume rows; the rest after them."""
ROUTING_IMBALANCE = 1.0
"""The routing the MoE simulations state (``--target.routing_imbalance``): on one GPU every
routed row stays on the rank, so only the balanced figure is meaningful."""


@dataclass
class Shape:
    """What the check runs, at full size on a GPU or tiny when rehearsing on the CPU."""

    loss_steps: int = 60
    steps: int = 8
    one_b: list[str] = field(default_factory=lambda: ["--config", "llama3_1b.toml"])
    eight_b: list[str] = field(default_factory=lambda: ["--config", "llama3_8b.toml"])
    moe: list[str] = field(
        default_factory=lambda: [
            "--config",
            "qwen3_30b_a3b.toml",
            "--parallelism.expert_parallel_degree",
            "1",
            "--training.global_batch_size",
            "-1",
        ]
    )
    """The preset is sized for 8 GPUs (ep 8, 64 sequences a step); on one, every expert is local
    and a step is one sequence, as for the dense presets."""
    moe_layers: tuple[int, ...] = MOE_LAYERS
    deepseek: list[str] = field(
        default_factory=lambda: [
            "--config",
            "deepseek_v3_16b.toml",
            "--parallelism.expert_parallel_degree",
            "1",
            "--training.global_batch_size",
            "-1",
        ]
    )
    """As ``moe``: the preset's 8 GPUs' experts all on the one."""
    qwen3: list[str] = field(default_factory=lambda: ["--config", "qwen3_8b.toml"])
    family_layers: tuple[int, ...] = FAMILY_LAYERS
    precision: list[str] = field(default_factory=lambda: ["--training.mixed_precision_param", "bfloat16"])
    seq_len: int = 8192
    cpu: bool = False


REHEARSAL = Shape(
    loss_steps=4,
    steps=5,
    one_b=["--model.flavor", "debugmodel"],
    eight_b=["--model.flavor", "debugmodel"],
    moe=["--model.name", "moe", "--model.flavor", "debugmoe", "--training.global_batch_size", "-1"],
    moe_layers=(2,),
    deepseek=[
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "deepseek_v3_debug",
        "--training.global_batch_size",
        "-1",
    ],
    qwen3=["--model.name", "qwen3", "--model.flavor", "qwen3_debug"],
    family_layers=(2,),
    precision=["--training.mixed_precision_param", "float32"],
    seq_len=256,
    cpu=True,
)


@dataclass
class Job:
    name: str
    args: list[str]
    note: str = ""
    simulation: list[str] = field(default_factory=list)
    """Options only the simulation of the job takes."""
    profiled: bool = False
    """One measured step is also traced: its top kernels and the MoE time split make a row."""


def throughput_jobs(shape: Shape, memory: int) -> list[Job]:
    """The jobs in their order of value, for a GPU of ``memory`` bytes."""
    eager, compiled = (
        ["--activation_checkpoint.mode", "none"],
        ["--compile.enable", "--activation_checkpoint.mode", "selective"],
    )
    chunked = ["--training.loss_chunk_tokens", "1024"]  # auto would not chunk where the GPU holds the logits
    common = ["--training.seq_len", str(shape.seq_len), "--training.steps", str(shape.steps)]
    one_b = [*shape.one_b, *shape.precision, *common]
    layers = layers_that_fit([*shape.eight_b, *common], EIGHT_B_LAYERS, memory)
    eight_b = [*shape.eight_b, "--model.n_layers", str(layers), *shape.precision, *common]
    moe_layers = layers_that_fit([*shape.moe, *common], shape.moe_layers, memory)
    moe = [*shape.moe, "--model.n_layers", str(moe_layers), *shape.precision, *common]
    moe_jobs = moe_work_jobs(shape, moe, moe_layers)
    return [
        *moe_jobs[:FIRST_JOBS],
        *family_jobs(shape, common, memory),
        *moe_jobs[FIRST_JOBS:],
        Job("1B", [*one_b, *eager], "eager, no AC"),
        Job(f"8B x {layers} layers", [*eight_b, *eager, *chunked], "eager, no AC, chunked loss"),
        Job("1B", [*one_b, *compiled], "compiled + selective AC"),
        Job(f"8B x {layers} layers", [*eight_b, *compiled], "compiled + selective AC"),
        Job(
            f"8B x {layers} layers",
            [*eight_b, *eager, "--training.loss_chunk_tokens", "0"],
            "eager, no AC, unchunked loss",
        ),
        *float8_jobs(shape, eight_b, layers),
    ]


def family_jobs(shape: Shape, common: list[str], memory: int) -> list[Job]:
    """One row per family the trainer added last (issue 57), each beside the simulator's
    prediction: DeepSeek-V3's latent attention and group-limited routing at the 16B preset's
    per-GPU work (8 micro-batches of one sequence, full AC, its sequence-wise balancing), and
    Qwen3-8B's QK-normed attention as the 8B Llama row runs (eager, no AC, chunked loss)."""
    deepseek_layers = layers_that_fit([*shape.deepseek, *common], shape.family_layers, memory)
    deepseek = [*shape.deepseek, "--model.n_layers", str(deepseek_layers), *shape.precision, *common]
    work = [*MOE_WORK, "--activation_checkpoint.mode", "full", "--training.steps", str(MOE_WORK_STEPS)]
    qwen3_layers = layers_that_fit([*shape.qwen3, *common], shape.family_layers, memory)
    qwen3 = [*shape.qwen3, "--model.n_layers", str(qwen3_layers), *shape.precision, *common]
    plain = ["--activation_checkpoint.mode", "none", "--training.loss_chunk_tokens", "1024"]
    return [
        Job(
            f"DeepSeek-V3 16B x {deepseek_layers} layers",
            [*deepseek, *work],
            f"{FAMILY}DeepSeek-V3, eager, full AC, 8 micro-batches, the preset's balancing, experts: {expert_path(shape)}",
            ["--target.routing_imbalance", str(ROUTING_IMBALANCE)],
        ),
        Job(f"Qwen3-8B x {qwen3_layers} layers", [*qwen3, *plain], f"{FAMILY}Qwen3, eager, no AC, chunked loss"),
    ]


def float8_jobs(shape: Shape, eight_b: list[str], layers: int) -> list[Job]:
    """Float8 beside bf16 (docs/float8.md): the 8B shape compiled with selective AC in bf16,
    tensorwise and rowwise side by side, MFU on the bf16 peak as torchtitan counts it; then the
    debug model's float8 loss curve, to set beside the bf16 curve of the loss job."""
    compiled = [*eight_b, "--compile.enable", "--activation_checkpoint.mode", "selective"]
    float8 = ["--model.converters", "float8", "--float8.recipe_name"]
    curve = ["--model.flavor", "debugmodel", *shape.precision, "--training.steps", str(shape.loss_steps)]
    return [
        Job(f"8B x {layers} layers", compiled, "compiled + selective AC, bf16 (the float8 rows' baseline)"),
        Job(f"8B x {layers} layers", [*compiled, *float8, "tensorwise"], "compiled + selective AC, float8 tensorwise"),
        Job(f"8B x {layers} layers", [*compiled, *float8, "rowwise"], "compiled + selective AC, float8 rowwise"),
        Job("debug model loss", [*curve, *float8, "rowwise"], f"float8 rowwise, {shape.loss_steps} steps"),
    ]


def moe_work_jobs(shape: Shape, moe: list[str], layers: int) -> list[Job]:
    """The MoE shape at ``layers`` blocks (``moe``: its options) as the preset runs it on each GPU,
    8 micro-batches a step with full activation checkpointing, for each balancing scope (the
    preset's weight), eager and compiled; the exact scope's eager run also traces a step. Then
    the exact scope eager with its held forwards in host memory (``moe.held_forwards = host``, as
    the preset on 8 H100s holds them), beside the first row: what the copies cost on this GPU.
    The first four come before the attention and resume rows (:data:`FIRST_JOBS`), the fifth
    after them and the newer families' rows."""
    experts = f"experts: {expert_path(shape)}"
    routing = ["--target.routing_imbalance", str(ROUTING_IMBALANCE)]
    work = [*MOE_WORK, "--activation_checkpoint.mode", "full", "--training.steps", str(MOE_WORK_STEPS)]
    jobs = []
    for compiled in (False, True):
        for scope in BALANCE_SCOPES:
            args = [*moe, *work, "--moe.balance_loss_weight", "0.001", "--moe.balance_loss_scope", scope]
            profiled = not compiled and scope == "global_batch"
            if profiled:  # the profiler's schedule traces step profile_freq, the second measured one
                args += ["--profiling.enable_profiling", "--profiling.profile_freq", str(MOE_WORK_STEPS - 1)]
            how = "compiled" if compiled else "eager"
            note = f"{how}, full AC, 8 micro-batches, moe.balance_loss_scope={scope}, {experts}"
            jobs.append(
                Job(
                    f"30B-A3B x {layers} layers",
                    [*args, "--compile.enable"] if compiled else args,
                    note,
                    routing,
                    profiled,
                )
            )
    exact = [*moe, *work, "--moe.balance_loss_weight", "0.001", "--moe.balance_loss_scope", "global_batch"]
    note = f"eager, full AC, 8 micro-batches, moe.balance_loss_scope=global_batch, moe.held_forwards=host, {experts}"
    jobs.append(Job(f"30B-A3B x {layers} layers", [*exact, "--moe.held_forwards", "host"], note, routing))
    return jobs


def layers_that_fit(argv: list[str], candidates: tuple[int, ...], memory: int) -> int:
    """The most blocks of ``candidates`` whose unchunked, un-checkpointed one-GPU job the memory
    estimate fits in :data:`FIT_FRACTION` of ``memory``: the largest shape the GPU measures
    without checkpointing's recompute blurring the step time."""
    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job

    for layers in candidates:
        job = [*argv, "--model.n_layers", str(layers)]
        job += ["--activation_checkpoint.mode", "none", "--training.loss_chunk_tokens", "0"]
        if resolve_job(load_config(job), 1, "cuda").memory.total <= FIT_FRACTION * memory:
            return layers
    return candidates[-1]


def expert_path(shape: Shape) -> str:
    """Which expert kernels the MoE rows run: the model's own test (``has_grouped_mm``: CUDA,
    bfloat16, sm90+) on a tensor of the job's device and precision, so that a slow row on an
    older GPU reads as the per-expert loop, not as a slow grouped matmul."""
    import torch

    from trainer.model.routed_experts import has_grouped_mm

    if not (shape.cpu or torch.cuda.is_available()):
        return "not known without a GPU"
    dtype = getattr(torch, shape.precision[-1])
    probe = torch.zeros(1, dtype=dtype, device="cpu" if shape.cpu else "cuda")
    return "grouped matmul" if has_grouped_mm(probe) else "per-expert loop"
