"""``torch.distributed.pipelining`` internals, and the ``nn.Module`` bookkeeping a stage split needs.

The trainer replicates RoPE positions to every micro-batch (the splitter's private ``_Replicate``
chunk spec). The simulator, which runs one pipeline rank alone over a fake process group, answers
the stages' shape exchange itself and runs fewer micro-batches than the schedule was built for,
through the schedule's and the stages' private members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.pipelining import _utils as pipelining_utils
from torch.distributed.pipelining.microbatch import _Replicate

FEATURE = "pipeline parallelism (parallelism.pipeline_parallel_degree)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")
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
)

Replicate = _Replicate
"""The chunk spec that hands every micro-batch the whole argument."""


def answer_metadata(
    schedule: Any, stages: list[Any], send: Callable[[object, int], None], receive: Callable[[Any, int], object]
) -> bool:
    """Make the stages infer their shapes and exchange them through ``send(meta, dst_stage)`` and
    ``receive(stage, src_stage)`` instead of P2P. False where the schedule has no such exchange
    (then it needs no answer)."""
    if not hasattr(schedule, "_warmup_p2p"):
        return False

    def infer_shapes(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = pipelining_utils.InferenceMode.DYNAMIC

    schedule._warmup_p2p = infer_shapes
    for stage in stages:
        stage._send_meta = send
        stage._recv_meta = functools.partial(receive, stage)
    return True


def is_forward_metadata(meta: object) -> bool:
    return isinstance(meta, pipelining_utils._StageForwardMeta)


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


def buffer_is_persistent(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict."""
    return name not in module._non_persistent_buffers_set
