"""One rank of the real job, run in this process on fake tensors and a fake process group.

The rank joins a fake process group of the job's world size (collectives move no data and
return at once), then the trainer's own code builds it: ``build_step_parts`` makes the mesh and
parallelises the model on the meta device outside the fake mode (FSDP x TP mesh concatenation
reads tensor values, which fake tensors do not have), then materialises it (drawing no initial
values: fake tensors hold none) and builds the optimizer, the accumulator and the pipeline
inside it. Each simulated rank runs in a forked child process (:func:`run_isolated`). Two training steps follow through
``trainer.train``'s own functions (the first creates the optimizer's state, the second is the
steady state), with the loader's batches of the configured shape. A
:class:`~trainer.simulation.memory_tracker.MemoryTracker` counts every storage;
a :class:`~trainer.simulation.cost_model.CostRecorder` counts the second step's FLOPs, memory
traffic and collectives.

Values are never computed: nothing numeric (loss, norms) can be learnt here, and where the
trainer reads one (the token count, the gradient norm) it reads 1.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import _utils as pipelining_utils
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import Dataset

from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline_parallel import Pipeline
from trainer.build import StepParts, build_step_parts
from trainer.grad_accumulator import StepResult
from trainer.plan import Plan
from trainer.simulation.cost_model import CostRecorder, TracedCost, group_infos
from trainer.simulation.memory_tracker import MemoryProfile, MemoryTracker, label_training_state
from trainer.train import fetch_step, forward_backward, optimizer_step

STEPS = 2


@dataclass
class RoleRun:
    """What one simulated rank measured."""

    rank: int
    pp_rank: int
    stages: list[int]
    memory: MemoryProfile
    cost: TracedCost
    seconds: float


class SyntheticSamples(Dataset):
    """Samples of the training shape (token 0 everywhere, every label valid): fake tensors need
    shapes, not text, and the job's own data may live on another machine."""

    def __init__(self, num_samples: int, seq_len: int):
        self.num_samples, self.seq_len = num_samples, seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.seq_len, dtype=torch.int64), torch.zeros(self.seq_len, dtype=torch.int64)


class _Allocating:
    """The fake mode with the tracker inside it, entered anew each time tensors are made."""

    def __init__(self, fake: FakeTensorMode, tracker: MemoryTracker):
        self.fake, self.tracker = fake, tracker
        self._stack: ExitStack | None = None

    def __enter__(self) -> _Allocating:
        self._stack = ExitStack()
        self._stack.enter_context(self.fake)
        self._stack.enter_context(self.tracker)
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


class PipelineMetadata:
    """Answers the pipeline stages' metadata exchange, which a fake group cannot carry.

    Before its first step torch's schedule votes over P2P on how to learn the stages' input and
    output shapes, then sends them from stage to stage as pickled objects; over a fake group
    nothing arrives. Here the vote is "infer" (no stage was given shapes), every stage boundary
    of this model passes hidden states of one shape, so the first forward metadata any stage
    sends is what every later stage receives (the simulator runs stage 0 first), and a stage's
    output-gradient metadata derives from its own outputs. Written against torch 2.13's
    ``PipelineStage`` internals; shared by all the roles of one simulation.
    """

    def __init__(self) -> None:
        self.forward: object | None = None

    def attach(self, pipeline: Pipeline) -> None:
        schedule = pipeline.schedule
        if not hasattr(schedule, "_warmup_p2p"):
            return

        def infer_shapes(stages: list, has_backward: bool, p2p_done: bool) -> None:
            for stage in stages:
                stage._inference_mode = pipelining_utils.InferenceMode.DYNAMIC

        schedule._warmup_p2p = infer_shapes
        for stage in pipeline.stages:
            stage._send_meta = self._send  # type: ignore[method-assign]
            stage._recv_meta = functools.partial(self._receive, stage)  # type: ignore[method-assign]

    def _send(self, meta: object, dst_stage: int) -> None:
        if isinstance(meta, pipelining_utils._StageForwardMeta) and self.forward is None:
            self.forward = meta

    def _receive(self, stage: object, src_stage: int) -> object:
        if src_stage > stage.stage_index:  # type: ignore[attr-defined]
            outputs = stage._stage_meta.outputs  # type: ignore[attr-defined]
            return pipelining_utils._StageBackwardMeta(backward_metas=pipelining_utils._derive_grad_metas(outputs))
        if self.forward is None:
            raise RuntimeError("pipeline stage metadata: simulate the first stage before the others")
        return self.forward


def rank_of_stage(plan: Plan, pp_rank: int) -> int:
    """The first global rank of pipeline rank ``pp_rank`` (pp is the mesh's outermost dimension)."""
    return pp_rank * (plan.dims.world_size // plan.dims.pp)


def run_rank(plan: Plan, rank: int, gpus_per_node: int, metadata: PipelineMetadata) -> RoleRun:
    """Build and step ``rank`` of ``plan``'s job in this process (see the module docstring)."""
    start = time.monotonic()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.dims.world_size)
    try:
        tracker = MemoryTracker()
        allocating = _Allocating(FakeTensorMode(allow_non_fake_inputs=True), tracker)
        samples = SyntheticSamples(STEPS * plan.global_batch_size, plan.config.training.seq_len)
        trainer = build_step_parts(plan, samples, allocating)
        if trainer.pipeline is not None:
            metadata.attach(trainer.pipeline)
        recorder = CostRecorder(group_infos(mesh_groups(trainer.meshes), gpus_per_node))
        tracker.observers.append(recorder)
        _label_state(tracker, trainer)
        tracker.label_live("buffers", keep=("params",))
        _phase_finalize(trainer, tracker)
        for step in range(1, STEPS + 1):
            microbatches = fetch_step(trainer)
            recorder.enabled = step == STEPS
            with allocating:
                tracker.set_phase("forward", step)
                tracker.stepping = True
                result: StepResult = forward_backward(trainer, microbatches)
                tracker.set_phase("optimizer")
                optimizer_step(trainer, result)
                _label_state(tracker, trainer)
        pp_rank = trainer.meshes.pp.get_local_rank()
        stages = [s.stage_index for s in trainer.pipeline.stages] if trainer.pipeline is not None else [0]
        profile = tracker.profile()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return RoleRun(rank, pp_rank, stages, profile, recorder.cost, time.monotonic() - start)


def run_isolated(plan: Plan, rank: int, gpus_per_node: int, metadata: PipelineMetadata) -> RoleRun:
    """:func:`run_rank` in a forked child, so that no mesh, process group or DTensor cache of one
    simulated rank outlives it (a mesh equals any mesh of the same shape, and torch caches by
    mesh); the stage metadata the rank learnt comes back with its results."""
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        run, forward = pool.apply(_run_child, (plan, rank, gpus_per_node, metadata.forward))
    if metadata.forward is None:
        metadata.forward = forward
    return run


def _run_child(plan: Plan, rank: int, gpus_per_node: int, forward: object | None) -> tuple[RoleRun, object | None]:
    metadata = PipelineMetadata()
    metadata.forward = forward
    return run_rank(plan, rank, gpus_per_node, metadata), metadata.forward


def mesh_groups(meshes: Meshes) -> dict[str, dist.ProcessGroup]:
    """Every process group of the job by the mesh dimension it spans; FSDP's first, so a group
    shared by several views (size-1 dimensions) is named as FSDP sees it."""
    groups: dict[str, dist.ProcessGroup] = {}
    for mesh in (meshes.fsdp, meshes.tp, meshes.cp, meshes.pp, meshes.batch, meshes.loss, meshes.stats):
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            groups.setdefault(name, mesh.get_group(dim))
    world = dist.group.WORLD
    if world is not None:
        groups.setdefault("world", world)
    return groups


def _phase_finalize(trainer: StepParts, tracker: MemoryTracker) -> None:
    """Mark the accumulator's finalize as a phase of its own (the loop calls it inside
    ``forward_backward``), and label the gradients it is about to scale."""
    finalize: Callable[[], StepResult] = trainer.accumulator.finalize

    def phased() -> StepResult:
        tracker.stepping = False
        tracker.set_phase("finalize")
        _label_state(tracker, trainer)
        return finalize()

    trainer.accumulator.finalize = phased  # type: ignore[method-assign]


def _label_state(tracker: MemoryTracker, trainer: StepParts) -> None:
    modules = [trainer.model] + ([s.submod for s in trainer.pipeline.stages] if trainer.pipeline else [])
    label_training_state(tracker, modules, trainer.optimizer)
