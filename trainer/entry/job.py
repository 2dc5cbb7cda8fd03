"""The one way in: every entry point prepares the job here, the same way.

The launcher (``./run_train.sh``), each worker (``python -m trainer.entry.worker``), ``--dry-run``,
``--simulate`` and ``scripts/show_batch.py`` all call :func:`prepare`: config -> plan for the world
size -> memory check -> datasets. Whatever can be wrong with the config, the mesh, the tokenizer or
the data raises a :class:`~trainer.runtime.errors.UserError` here, before any process group exists,
and the entry point prints it as one line; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer.checkpoint.resume_fit import resume_preview
from trainer.config import load_config
from trainer.data.datasets import TokenDataset, data_lines, load_dataset, load_validation_dataset
from trainer.metrics.wandb_sink import check_wandb_installed
from trainer.optimizer import schedule_settings
from trainer.planning.held_for_speed import fitted
from trainer.planning.job_plan import JobPlan, check_memory, describe, resolve_job
from trainer.planning.memory_limits import memory_limit, target_device
from trainer.planning.target_figures import parse_overrides
from trainer.planning.workload import Workload
from trainer.replica_groups import check_lighthouse, lighthouse_address
from trainer.runtime.dump_folder import check_dump_folder
from trainer.runtime.errors import ConfigError

DEFAULT_TARGET = "h100"


@dataclass
class Request:
    """What the command line asks of an entry point, apart from the training settings."""

    mode: str = "train"
    """``train``; ``dry_run`` (check and describe); ``simulate`` (run one step on fake tensors);
    ``help``."""
    argv: list[str] = field(default_factory=list)
    """The training settings (``--config``, ``--mesh``, ``--section.key VALUE``)."""
    target_gpu: str | None = None
    """``--target-gpu NAME``: plan for that GPU instead of this machine."""
    target_overrides: dict[str, str] = field(default_factory=dict)
    """``--target.KEY VALUE``: the target's figures as the user states them."""

    @property
    def target(self) -> str | None:
        """The machine planned for: ``--target-gpu``, or the simulator's default GPU when only
        ``--target.*`` figures are given (they describe a GPU, not this machine)."""
        return self.target_gpu or (DEFAULT_TARGET if self.target_overrides else None)

    @property
    def figures(self) -> dict[str, float]:
        return parse_overrides(self.target_overrides)


def parse_request(argv: list[str]) -> Request:
    """Split the entry point's own flags from the training settings."""
    request, rest, i = Request(), [], 0
    while i < len(argv):
        arg = argv[i]
        name, has_value, value = arg.partition("=")
        if arg in ("--help", "-h"):
            request.mode = "help"
        elif arg in ("--dry-run", "--simulate"):
            mode = "dry_run" if arg == "--dry-run" else "simulate"
            if request.mode not in ("train", mode):
                raise ConfigError(
                    "`--dry-run` and `--simulate` are two ways to check a job: `--dry-run` plans it "
                    "(seconds), `--simulate` runs a step of it on fake tensors (minutes); give one."
                )
            request.mode = mode
        elif name == "--target-gpu" or name.startswith("--target."):
            if not has_value:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"`{name}` needs a value, e.g. `{name} h100`.")
                i, value = i + 1, argv[i + 1]
            if name == "--target-gpu":
                request.target_gpu = value
            else:
                request.target_overrides[name.removeprefix("--target.")] = value
        else:
            rest.append(arg)
        i += 1
    if (request.target_gpu or request.target_overrides) and request.mode not in ("dry_run", "simulate", "help"):
        raise ConfigError(
            "`--target-gpu` and `--target.*` plan for another machine: use them with `--dry-run` or `--simulate`."
        )
    request.argv = rest
    parse_overrides(request.target_overrides)  # a wrong figure is told before anything is planned
    return request


@dataclass
class PreparedJob:
    """A job checked from end to end and ready to build: its plan and its data."""

    plan: JobPlan
    dataset: TokenDataset
    validation_dataset: TokenDataset | None

    def data_lines(self) -> str:
        return data_lines(self.plan.config, self.plan.global_batch_size, self.dataset, self.validation_dataset)

    def resume_lines(self) -> list[str]:
        """What the run would resume, read from beside the checkpoint; a checkpoint of another
        model, or trained on other data, is refused here as the resume would refuse it."""
        config = self.plan.config
        schedule = schedule_settings(config.training.steps, config.optimizer.lr, config.lr_scheduler)
        data = getattr(self.dataset, "identity", None) or {}
        return resume_preview(config.checkpoint, config.job.dump_folder, self.plan.model_args, data, schedule)


def prepare(
    argv: list[str],
    world_size: int,
    *,
    local_ranks: int,
    device_index: int | None = None,
    started: bool = False,
    target: str | None = None,
    figures: dict[str, float] | None = None,
    describe_to: list[str] | None = None,
    memory: bool = True,
) -> PreparedJob:
    """Load the config, plan it for ``world_size``, check its dump folder and memory, open its datasets.

    ``local_ranks``, ``device_index`` and ``started`` say where the memory limit comes from: this
    node's ranks sharing its RAM or GPUs, and whether they have started (see
    :func:`trainer.planning.job_plan.memory_limit`); ``target`` (``--target-gpu``) plans for one GPU of that
    kind per rank instead, from any machine, with its ``--target.*`` ``figures``. ``describe_to``
    collects what the job will be, for ``--dry-run``, before the memory check can refuse it, and
    the checkpoint it would resume. ``memory=False`` skips the check (a tool that only reads the data).
    """
    limit, where = memory_limit(local_ranks, device_index, started=started, target=target, figures=figures)
    job_plan = prepare_plan(argv, world_size, target, figures, limit)
    check_wandb_installed(job_plan.config.metrics.enable_wandb)
    if describe_to is not None:
        describe_to.append(describe(job_plan, limit, where))
    elif memory:
        check_memory(job_plan, limit, where)
    job = PreparedJob(
        job_plan,
        load_dataset(job_plan.config, job_plan.tokenizer, job_plan.global_batch_size),
        load_validation_dataset(job_plan.config, job_plan.tokenizer),
    )
    if describe_to is not None:
        describe_to += [job.data_lines(), *job.resume_lines()]
        if memory:
            check_memory(job_plan, limit, where)
    return job


def prepare_plan(
    argv: list[str],
    world_size: int,
    target: str | None = None,
    figures: dict[str, float] | None = None,
    limit: int | None = None,
) -> JobPlan:
    """What :func:`prepare` checks before it opens the data: the config, its plan for
    ``world_size`` (on one GPU of kind ``target`` with its ``figures``, when given, and ``limit``
    bytes per rank), the dump folder. ``--simulate`` stops here: it feeds synthetic batches, and
    the data may be on another machine."""
    device = target_device(target) if target else None
    job_plan = resolve_job(load_config(argv), world_size, device, figures, limit)
    job_plan = fitted_plan(job_plan, limit)
    check_dump_folder(job_plan.config.job.dump_folder)
    return job_plan


def fitted_plan(plan: JobPlan, memory_limit: int | None) -> JobPlan:
    """``plan`` for a rank of ``memory_limit`` bytes (None: unknown), where exact MoE balancing
    holds the step's forwards, and routed experts over one rank stay gathered, only if they fit
    (``trainer/planning/held_for_speed.fitted``)."""
    return holding_as(plan, fitted(plan.workload, memory_limit))


def holding_as(plan: JobPlan, decided: Workload) -> JobPlan:
    """``plan``, holding for speed what ``decided`` holds (``held_for_speed.fitted``): the held
    forwards, their loss's gradients, the routed experts kept gathered."""
    workload = replace(
        plan.workload,
        hold_forwards=decided.hold_forwards,
        offload_forwards=decided.offload_forwards,
        hold_loss_gradients=decided.hold_loss_gradients,
        gathers_one_rank_experts=decided.gathers_one_rank_experts,
    )
    parallel = replace(plan.parallel, experts_stay_gathered=workload.experts_stay_gathered)
    return replace(plan, workload=workload, parallel=parallel)


def describe_job(request: Request, world_size: int, local_ranks: int) -> None:
    """``--dry-run``: check everything and print what the job would be, the plan and memory
    estimate first, so that they are shown even when the memory check refuses the job; a
    replica group's lighthouse must answer, as for the launch."""
    lines: list[str] = []
    try:
        job = prepare(
            request.argv,
            world_size,
            local_ranks=local_ranks,
            target=request.target,
            figures=request.figures,
            describe_to=lines,
        )
        ft = job.plan.config.fault_tolerance
        if ft.enable:  # as the launch would: a missing or silent lighthouse is refused before any process starts
            check_lighthouse(ft)
            lines.append(f"lighthouse: {lighthouse_address(ft)} answers")
    finally:
        print("\n".join(lines), flush=True)
