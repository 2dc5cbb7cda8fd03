"""``torch.distributed.pipelining`` internals, and the ``nn.Module`` bookkeeping a stage split needs.

The trainer replicates RoPE positions to every micro-batch (the splitter's private ``_Replicate``
chunk spec) and makes the zero-bubble schedules' split backward see the stage's unsharded FSDP
parameters (:func:`split_backward_on_unsharded`, through each stage's
``backward_maybe_with_nosync``). The simulator, which runs one pipeline rank alone over a fake
process group, answers the stages' shape exchange itself and runs fewer micro-batches than the
schedule was built for, through the schedule's and the stages' private members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import _utils as pipelining_utils
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining.microbatch import _Replicate

FEATURE = "pipeline parallelism (parallelism.pipeline_parallel_degree)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = (
    "_Replicate",
    "_utils",
    "_warmup_p2p",
    "_inference_mode",
    "_send_meta",
    "_recv_meta",
    "_StageForwardMeta",
    "_StageBackwardMeta",
    "_derive_grad_metas",
    "_stage_meta",
    "_n_microbatches",
    "_prepare_forward_infra",
    "_prepare_backward_infra",
    "_non_persistent_buffers_set",
    "_get_init_p2p_neighbors_ops",
    "_initialize_pipeline_distributed_state",
)

Replicate = _Replicate
"""The chunk spec that hands every micro-batch the whole argument."""


SHORTENED_UP_TO = (2, 14)
"""The last release on which the simulator's shortened pipeline trace was checked against the
whole one: on 2.15 a whole 1F1B step holds two micro-batches' stage activations more at its peak
than the shortened trace accounts for, so the simulation traces every micro-batch there."""


def shortened_trace_checked(version: str | None = None) -> bool:
    from parallelisms.torch_private import release

    return release(version or torch.__version__) <= SHORTENED_UP_TO


def answer_metadata(
    schedule: Any, stages: list[Any], send: Callable[[object, int], None], receive: Callable[[Any, int], object]
) -> None:
    """Make the stages exchange their shape metadata through ``send(meta, dst_stage)`` and
    ``receive(stage, src_stage)`` instead of P2P.

    torch 2.13 and later vote on how to learn the shapes (``_warmup_p2p``; 2.15's
    ``_initialize_pipeline_distributed_state``), then send
    ``_StageForwardMeta`` objects through each stage's ``_send_meta``/``_recv_meta``; here the
    vote is "infer". torch 2.11 infers the shapes in each stage's ``_shape_inference``, which sends
    the outputs' meta tensors with ``dist.send_object_list``: those calls, made from the
    pipelining stage module, go to ``send`` and ``receive`` as :class:`TensorShapes`.
    """
    if hasattr(schedule, "_warmup_p2p") or hasattr(schedule, "_initialize_pipeline_distributed_state"):

        def infer_shapes(stages: list, has_backward: bool, p2p_pending: bool) -> None:
            for stage in stages:
                stage._inference_mode = pipelining_utils.InferenceMode.DYNAMIC

        if hasattr(schedule, "_warmup_p2p"):
            schedule._warmup_p2p = infer_shapes
        else:  # 2.15, which also refuses a fake process group unless every stage was given its shapes
            schedule._initialize_pipeline_distributed_state = infer_shapes
        for stage in stages:
            stage._send_meta = send
            stage._recv_meta = functools.partial(receive, stage)
        return
    stage_module.dist = _ObjectsAnswered(send, functools.partial(receive, stages[0], -1))  # type: ignore[assignment]


@dataclass(frozen=True)
class TensorShapes:
    """Picklable meta tensors (a fake tensor is not picklable): what a stage's outputs look like."""

    specs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, bool] | None, ...]

    @classmethod
    def of(cls, values: tuple) -> TensorShapes:
        return cls(
            tuple(
                (tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else None
                for v in values
            )
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(grad)
            for shape, stride, dtype, grad in (s for s in self.specs if s is not None)
        )


class _ObjectsAnswered:
    """``torch.distributed`` as torch 2.11's pipelining stages see it, with its object-list P2P
    answered by the simulator (a fake process group carries no objects)."""

    def __init__(self, send: Callable[[object, int], None], receive: Callable[[], object]) -> None:
        self._send, self._receive = send, receive

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def send_object_list(self, objects: list, *args: Any, **kwargs: Any) -> None:
        self._send(TensorShapes.of(objects[0]), -1)

    def recv_object_list(self, objects: list, *args: Any, **kwargs: Any) -> None:
        received = self._receive()
        objects[0] = received.tensors() if isinstance(received, TensorShapes) else received


def no_warmup_with_itself(stages: list[Any]) -> None:
    """Keep each stage's P2P warm-up to stages on other ranks.

    Before the first step, torch 2.11's schedules (2.13's where a stage has no shape-inference
    vote) send a dummy tensor to and from each neighbouring stage, also one on the same rank, as
    the V-shaped schedules place them (stages 1 and 2 of ``ZBVZeroBubble`` on pipeline rank 1);
    gloo cannot send to its own rank ("Pair is not connected"). Neighbours on one rank exchange
    activations in memory, so their warm-up has nothing to warm.
    """
    for stage in stages:
        warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
        if warmup is not None:
            stage._get_init_p2p_neighbors_ops = functools.partial(_to_others, warmup, stage.group_rank)


def _to_others(warmup: Callable[[], list[Any]], own_rank: int) -> list[Any]:
    return [op for op in warmup() if op.group_peer != own_rank]


def split_backward_on_unsharded(stages: list[Any]) -> None:
    """Unshard every FSDP unit of a stage before each half of its split backward.

    The zero-bubble schedules run a stage's backward in two halves: the input gradients
    (``stage_backward_input``: ``autograd.grad`` to the stage inputs, keeping the graph), then the
    weight gradients (``stage_backward_weight``: ``autograd.grad`` from the saved intermediates
    to the weights). Both take the weights from ``submod.parameters()`` *before* they run, and
    match them to the micro-batch's graph by their gradient accumulators. FSDP2 registers a
    unit's sharded parameters on its modules while it is resharded and its unsharded ones while
    it is unsharded, and the graph holds the unsharded ones. A unit resharded since the
    micro-batch's forward (every unit but the root under ``reshard_after_forward``, such as the
    routed experts' own unit inside each MoE block; under ``"always"`` the root too) lists
    parameters that are not in the graph: the input half puts them in no weight group, and the
    weight half computes nothing for them, so that micro-batch's gradient for the unit's
    parameters is silently dropped (measured on torch 2.13: the routed experts of
    ``pp=2,dp_shard=2,ep=2`` kept 1 or 2 of 4 micro-batches' gradients). Unsharding first, as the
    unit's own pre-backward hook would a moment later, makes the listed parameters the graph's.
    The full backward (``autograd.backward``) accumulates every leaf of the graph and needs none
    of this.
    """
    for stage in stages:
        stage.backward_maybe_with_nosync = functools.partial(
            _unsharded_first, stage.backward_maybe_with_nosync, stage.submod
        )


def _unsharded_first(backward: Callable[..., Any], submod: nn.Module, backward_type: str, *args: Any, **kwargs: Any):
    if backward_type in ("input", "weight"):
        for module in submod.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
    return backward(backward_type, *args, **kwargs)


def is_forward_metadata(meta: object) -> bool:
    forward_meta = getattr(pipelining_utils, "_StageForwardMeta", TensorShapes)  # torch 2.13 and later
    return isinstance(meta, (forward_meta, TensorShapes))


def backward_metadata(stage: Any) -> object:
    """The output-gradient metadata ``stage`` would receive: derived from its own outputs."""
    outputs = stage._stage_meta.outputs
    return pipelining_utils._StageBackwardMeta(backward_metas=pipelining_utils._derive_grad_metas(outputs))


def run_fewer_microbatches(schedule: Any, stages: list[Any], count: int, real: int) -> None:
    """Make ``schedule`` run ``count`` micro-batches while each stage allocates the receive
    buffers of ``real`` ones, as it does in the job."""
    schedule._n_microbatches = count
    for stage in stages:
        stage._prepare_forward_infra = _for_microbatches(stage._prepare_forward_infra, real)
        stage._prepare_backward_infra = _for_microbatches(stage._prepare_backward_infra, real)


def _for_microbatches(prepare: Callable[..., Any], count: int) -> Callable[..., Any]:
    @functools.wraps(prepare)
    def preparing(num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        return prepare(count, *args, **kwargs)

    return preparing


_inferring_metadata = False


def in_metadata_inference() -> bool:
    """True while a stage runs its modules to learn its shapes rather than to train or evaluate."""
    return _inferring_metadata


def mark_metadata_inference(stages: list[Any]) -> None:
    """Make :func:`in_metadata_inference` true while ``stages`` learn their shapes.

    Before its first step, and again at each switch between ``eval`` and ``step``, a schedule runs
    every stage forward (and backward to its inputs) on a micro-batch of real or empty tensors, in
    ``_prepare_forward_infra`` / ``_prepare_backward_infra``. Layers that count what passes
    through them (the MoE routing) must not count that pass.
    """
    for stage in stages:
        stage._prepare_forward_infra = _inferring(stage._prepare_forward_infra)
        stage._prepare_backward_infra = _inferring(stage._prepare_backward_infra)


def _inferring(prepare: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare)
    def preparing(*args: Any, **kwargs: Any) -> Any:
        global _inferring_metadata
        _inferring_metadata = True
        try:
            return prepare(*args, **kwargs)
        finally:
            _inferring_metadata = False

    return preparing


def buffer_is_persistent(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict."""
    return name not in module._non_persistent_buffers_set


CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def observe_chunks(stages: list[Any], running: Callable[[int], None], after_backward: Callable[[], None]) -> None:
    """Call ``running(chunk)`` before each stage computes one of a step's micro-batches (and its
    transfers after it), ``after_backward()`` after each backward one: torch's schedules offer no
    hook, so each stage's chunk methods are wrapped."""
    for stage in stages:
        for name in CHUNK_METHODS:
            setattr(
                stage, name, _observed(getattr(stage, name), running, after_backward if "backward" in name else None)
            )


def _observed(
    method: Callable[..., Any], running: Callable[[int], None], after: Callable[[], None] | None
) -> Callable[..., Any]:
    @functools.wraps(method)
    def observed(chunk: int, *args: Any, **kwargs: Any) -> Any:
        running(chunk)
        result = method(chunk, *args, **kwargs)
        if after is not None:
            after()
        return result

    return observed
