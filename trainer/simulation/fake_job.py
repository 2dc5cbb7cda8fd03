"""One rank of the real job, run in this process on fake tensors and a fake process group.

The rank joins a fake process group of the job's world size (collectives move no data and
return at once), then the trainer's own code builds it: ``build_training`` makes the mesh and
parallelises the model on the meta device outside the fake mode (FSDP x TP mesh concatenation
reads tensor values, which fake tensors do not have), then materialises it (drawing no initial
values: fake tensors hold none) and builds the optimizer, the accumulator and the pipeline
inside it. The optimizer's state is made as its first step would make it, then one steady
training step runs through ``trainer.step``'s own functions, with the loader's batches of the
configured shape (shortened to a few micro-batches: ``microbatches.py``). A
:class:`~trainer.simulation.memory_tracker.MemoryTracker` counts every storage; a
:class:`~trainer.simulation.cost_model.CostRecorder` counts the step's FLOPs, memory traffic
and collectives, by micro-batch. ``roles.py`` runs each simulated rank in a process of its own.

Values are never computed: nothing numeric (loss, norms) can be learnt here, and where the
trainer reads one (the token count, the gradient norm) it reads 1.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention import bias as attention_bias
from torch.utils.data import Dataset

from parallelisms.expert_parallel import AssumedRouting, assume_routing
from parallelisms.moe_split import SPLIT
from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline_parallel import Pipeline
from parallelisms.torch_private import fsdp, pipelining
from parallelisms.torch_private.fake import FakeStore, FakeTensorMode, PausingModTracker, disable_current_modes
from trainer.build import build_training
from trainer.planning.job_plan import JobPlan
from trainer.simulation.cost_model import CostRecorder, TracedCost, group_infos
from trainer.simulation.fusion import nbytes
from trainer.simulation.memory_tracker import MemoryProfile, MemoryTracker, label_training_state
from trainer.simulation.microbatches import extend, rank_count, schedule_count, steady_microbatches
from trainer.step.host_offload import MIN_BYTES, HostOffload
from trainer.step.part import StepPart, StepResult
from trainer.step.train_step import train_step
from trainer.train_state import TrainState
from trainer.training import Training


@dataclass
class RoleRun:
    """What one simulated rank measured."""

    rank: int
    pp_rank: int
    stages: list[int]
    memory: MemoryProfile
    cost: TracedCost
    """Extended to the job's micro-batches."""
    traced_microbatches: int
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


class _SimulatedOffload(HostOffload):
    """Held forwards in host memory, on fake tensors: what goes to the host leaves the device's
    count (its host copy, made outside the modes on the meta device, is not tracked) and comes
    back as a new device tensor; the recorder counts each copy's bytes."""

    def __init__(self, device: torch.device, recorder: CostRecorder):
        super().__init__(device, MIN_BYTES)  # the GPU's choice: the simulated device is one
        self.recorder = recorder

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.recorder.host_copy(nbytes(t))
        with disable_current_modes():
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    def fetch(self, microbatch: int) -> None:
        """What comes back counts as the cost of the micro-batch it belongs to, not of the one
        whose backward runs meanwhile: a shortened trace's steady micro-batch has its own."""
        running, self.recorder.microbatch = self.recorder.microbatch, microbatch
        try:
            super().fetch(microbatch)
        finally:
            self.recorder.microbatch = running

    def _copy_back(self, host: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.recorder.host_copy(nbytes(host))
        return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device), None


class PipelineMetadata:
    """Answers the pipeline stages' metadata exchange, which a fake group cannot carry.

    Before its first step torch's schedule votes over P2P on how to learn the stages' input and
    output shapes, then sends them from stage to stage as pickled objects; over a fake group
    nothing arrives. Here the vote is "infer" (no stage was given shapes), every stage boundary
    of this model passes hidden states of one shape, so the first forward metadata any stage
    sends is what every later stage receives (``roles.py`` starts the others once stage 0 has
    sent it), and a stage's output-gradient metadata derives from its own outputs. Written
    against ``PipelineStage``'s internals (``parallelisms/torch_private/pipelining.py``).
    """

    def __init__(self, forward: object | None = None, publish: Callable[[object], None] | None = None) -> None:
        self.forward = forward
        self.publish = publish
        """Told the first forward metadata this rank sends (the other stages wait for it)."""

    def attach(self, pipeline: Pipeline) -> None:
        pipelining.answer_metadata(pipeline.schedule, pipeline.stages, self._send, self._receive)

    def _send(self, meta: object, dst_stage: int) -> None:
        if pipelining.is_forward_metadata(meta) and self.forward is None:
            self.forward = meta
            if self.publish is not None:
                self.publish(meta)

    def _receive(self, stage: object, src_stage: int) -> object:
        if src_stage > stage.stage_index:  # type: ignore[attr-defined]
            return pipelining.backward_metadata(stage)
        if self.forward is None:
            raise RuntimeError("pipeline stage metadata: simulate the first stage before the others")
        return self.forward


def run_rank(
    plan: JobPlan,
    rank: int,
    gpus_per_node: int,
    metadata: PipelineMetadata,
    real_microbatches: int,
    shorten: bool = True,
) -> RoleRun:
    """Build and step ``rank`` of ``plan``'s job in this process (see the module docstring);
    its cost is extended to ``real_microbatches`` a step, and under PP it traces only the
    micro-batches its pipeline rank needs unless not ``shorten`` (``microbatches.py``)."""
    start = time.monotonic()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.dims.world_size)
    try:
        tracker = MemoryTracker()
        simulated = Simulated(_Allocating(FakeTensorMode(allow_non_fake_inputs=True), tracker), gpus_per_node)
        samples = SyntheticSamples(plan.global_batch_size, plan.config.training.seq_len)
        training = build_training(plan, samples, simulated)
        recorder = simulated.recorder
        if training.pipeline is not None:
            metadata.attach(training.pipeline)
        experts = plan.workload.experts
        for module in _modules(training):
            assume_routing(module, AssumedRouting(experts.imbalance if experts else 1.0))
        tracker.observers.append(recorder)
        _label_state(tracker, training)
        tracker.label_live("buffers", keep=("params",))
        with simulated.tensors:
            _create_optimizer_state(training, tracker)
        pp_rank = training.meshes.pp.get_local_rank()
        traced = rank_count(plan, pp_rank) if shorten else schedule_count(plan)
        if training.pipeline is not None and traced < real_microbatches:
            training.pipeline.shorten(traced, real_microbatches)
        recorder.enabled = True
        modules = PausingModTracker(pipelining.in_metadata_inference)
        recorder.where = functools.partial(_where, tracker, modules)
        recorder.after_graph = fsdp.autograd_engine_op
        SPLIT.naming = True
        with modules, simulated.tensors, _attention_biases_outside_the_fake_mode():
            train_step(training.step, TrainState())
            _label_state(tracker, training)
        stages = [s.stage_index for s in training.pipeline.stages] if training.pipeline is not None else [0]
        profile = tracker.profile()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    steady = steady_microbatches(plan, traced)
    cost = extend(recorder.costs, traced, real_microbatches, steady, reduces_last=plan.dims.pp > 1)
    return RoleRun(rank, pp_rank, stages, profile, cost, traced, time.monotonic() - start)


class Simulated:
    """What a simulated rank is built with instead (``trainer.build.Substitutes``): the fake mode
    with the memory tracker inside it, the recorder of the step's costs, its host offload, and
    the parts that watch the step through the same phases as every other part."""

    def __init__(self, tensors: _Allocating, gpus_per_node: int):
        self.tensors = tensors
        self.gpus_per_node = gpus_per_node
        self._recorder: CostRecorder | None = None

    @property
    def recorder(self) -> CostRecorder:
        if self._recorder is None:
            raise RuntimeError("the recorder is made with the step's watchers, once the meshes exist")
        return self._recorder

    def watchers(
        self, meshes: Meshes, model: torch.nn.Module, pipeline: Pipeline | None, optimizer: torch.optim.Optimizer
    ) -> tuple[StepPart, StepPart]:
        """The first part of the step and the one just before its optimizer step."""
        self._recorder = CostRecorder(group_infos(mesh_groups(meshes), self.gpus_per_node))
        watch = WatchedStep(self.tensors.tracker, self._recorder, [model], optimizer)
        if pipeline is not None:
            watch.modules += [s.submod for s in pipeline.stages]
            pipeline.observe_chunks(watch.running, watch.label)
        return watch, OptimizerPhase(self.tensors.tracker)

    def offload(self, device: torch.device) -> HostOffload:
        return _SimulatedOffload(device, self.recorder)


class WatchedStep(StepPart):
    """The simulator's first part: which micro-batch each forward and backward is (each forward
    is its micro-batch's, a counting pre-pass's and held forwards' too, which run before any
    backward; under PP the schedule's chunks tell), the step's phases for the memory tracker,
    and before each backward what FSDP holds unsharded (the last one reduces and frees it)."""

    def __init__(
        self,
        tracker: MemoryTracker,
        recorder: CostRecorder,
        modules: list[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
    ):
        self.tracker, self.recorder, self.modules, self.optimizer = tracker, recorder, modules, optimizer

    def begin(self, batch: list) -> None:
        self.tracker.set_phase("forward", 1)
        self.tracker.stepping = True

    def before_forward(self, microbatch: int) -> None:
        self.recorder.microbatch = microbatch

    def before_backward(self, microbatch: int) -> None:
        self.recorder.microbatch = microbatch
        self.label()

    def running(self, chunk: int) -> None:
        self.recorder.microbatch = chunk

    def label(self) -> None:
        label_training_state(self.tracker, self.modules, self.optimizer)

    def finish(self, result: StepResult) -> None:
        """The finalize: a phase of its own, run by no micro-batch; labels the gradients it is
        about to scale."""
        self.tracker.stepping = False
        self.recorder.microbatch = None
        self.tracker.set_phase("finalize")
        self.label()


class OptimizerPhase(StepPart):
    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker

    def finish(self, result: StepResult) -> None:
        self.tracker.set_phase("optimizer")


def _where(tracker: MemoryTracker, modules: PausingModTracker) -> tuple[str, bool]:
    """The breakdown row of the op running: its phase, its innermost module (the blocks'
    indices as ``*``) and its MoE part; and whether compile traces it (inside a block or the loss)."""
    name = max(modules.parents, key=len).split(".", 1)[-1] if len(modules.parents) > 1 else ""
    name = re.sub(r"\.\d+(?=\.|$)", ".*", name)
    part = SPLIT.current
    # Expert parallelism's all-to-alls run eagerly inside a block: collectives and integer sorts.
    compiled = name.startswith("layers.") or name == "output"  # the output projection's chunked loss
    compiled = compiled and not fsdp.called_from_fsdp()  # its hooks run around the compiled block
    return f"{tracker.phase} {name or '-'}" + (f"/{part}" if part else ""), compiled


@contextlib.contextmanager
def _attention_biases_outside_the_fake_mode() -> Iterator[None]:
    """Make torch's causal attention biases (tensor subclasses holding no data, which context
    parallelism's attention passes to SDPA) outside the fake mode and the tracker: made inside
    them, their tensor is already another subclass's and cannot become one of theirs."""
    originals = {name: getattr(attention_bias, name) for name in ("causal_lower_right", "causal_upper_left")}

    def outside(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(make)
        def making(*sizes: int) -> torch.Tensor:
            with disable_current_modes():
                return make(*sizes)

        return making

    for name, make in originals.items():
        setattr(attention_bias, name, outside(make))
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(attention_bias, name, make)


def mesh_groups(meshes: Meshes) -> dict[str, dist.ProcessGroup]:
    """Every process group of the job by the mesh dimension it spans; FSDP's first, so a group
    shared by several views (size-1 dimensions) is named as FSDP sees it."""
    groups: dict[str, dist.ProcessGroup] = {}
    experts = [m for m in (meshes.ep, meshes.expert_fsdp) if m is not None]
    views = (meshes.fsdp, meshes.tp, meshes.cp, meshes.pp, meshes.batch, meshes.loss, meshes.stats)
    for mesh in (*views, meshes.routing, meshes.replicated_fsdp, *experts):
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            groups.setdefault(name, mesh.get_group(dim))
    world = dist.group.WORLD
    if world is not None:
        groups.setdefault("world", world)
    return groups


def _create_optimizer_state(training: Training, tracker: MemoryTracker) -> None:
    """Make AdamW's state before the traced step, so that it is a steady one, as every step
    after the first is. The state is made as AdamW's first step makes it (``create_adamw_state``),
    not by that step: DTensor plans a fused or multi-tensor op over a rank's hundreds of
    parameters for seconds, a cost the traced step pays once already."""
    tracker.set_phase("optimizer", 0)
    create_adamw_state(training.optimizer.optimizer)
    _label_state(tracker, training)


def create_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """The state ``torch.optim.AdamW`` makes for each parameter on its first step (its
    ``_init_group``); ``tests/test_simulation_shortened.py`` checks it against a real first step."""
    for group in optimizer.param_groups:
        if group.get("muon"):  # Muon's one buffer per matrix (trainer/muon.py)
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
            continue
        on_device = group["fused"] or group["capturable"]
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            step_device = param.device if on_device else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _label_state(tracker: MemoryTracker, training: Training) -> None:
    label_training_state(tracker, _modules(training), training.optimizer.optimizer)


def _modules(training: Training) -> list[torch.nn.Module]:
    return [training.model] + ([s.submod for s in training.pipeline.stages] if training.pipeline else [])
