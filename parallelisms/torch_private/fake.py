"""Fake tensors, the fake process group and dispatch modes: what ``--simulate`` runs the job on."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

FEATURE = "the simulator (--simulate)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = (
    "_subclasses",
    "_tools",
    "ModTracker",
    "FakeTensor",
    "FakeTensorMode",
    "_internal",
    "FakeStore",
    "_python_dispatch",
    "TorchDispatchMode",
    "_disable_current_modes",
    "is_traceable_wrapper_subclass",
    "_pytree",
    "tree_map_only",
    "_local_scalar_dense",
    "_C",
    "_current_graph_task_id",
    "_type",
    "_fw_pre_hook",
    "_fw_post_hook",
)

__all__ = [
    "LOCAL_SCALAR",
    "FakeStore",
    "FakeTensor",
    "FakeTensorMode",
    "ModTracker",
    "PausingModTracker",
    "TorchDispatchMode",
    "disable_current_modes",
    "in_backward",
    "is_traceable_wrapper_subclass",
    "process_group_name",
    "tree_map_only",
]

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
"""The op behind ``.item()``: a fake tensor has no value to give."""
disable_current_modes = _disable_current_modes


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


def process_group_name(value: Any) -> str | None:
    """The group name of a process group boxed as a TorchScript object (``c10d`` ops' argument)."""
    if isinstance(value, torch.ScriptObject) and value._type().qualified_name().endswith("ProcessGroup"):
        return torch.distributed.ProcessGroup.unbox(value).group_name
    return None


class PausingModTracker(ModTracker):
    """A ``ModTracker`` that follows no module while ``paused()``.

    It hooks the gradients of every module's inputs to know when their backward ends; a pipeline
    stage learning its shapes asks autograd for the gradients of its own input, a leaf, and
    autograd refuses such hooks on a leaf inside ``autograd.grad``. That pass is not the step's.
    """

    def __init__(self, paused: Callable[[], bool]) -> None:
        super().__init__()
        self._paused = paused

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        if not self._paused():
            super()._fw_pre_hook(mod, input)

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        if not self._paused():
            super()._fw_post_hook(mod, input, output)


@contextlib.contextmanager
def observing_storage_resizes(resized: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``resized(storage)`` after every ``UntypedStorage.resize_`` within the block: FSDP frees
    and reallocates its gathered parameters by resizing their storages, which no dispatch mode sees."""
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        resized(storage)
        return result

    setattr(torch.UntypedStorage, "resize_", resize_)  # noqa: B010 - a method of torch's own class
    try:
        yield
    finally:
        setattr(torch.UntypedStorage, "resize_", original)  # noqa: B010
