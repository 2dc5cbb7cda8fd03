"""Live tensor bytes of one simulated rank, over time, by what they hold: measured, not a formula.

A :class:`MemoryTracker` is a dispatch mode entered inside ``FakeTensorMode``: every op's
outputs are fake tensors with storages of real sizes. The first time a storage appears it is
counted (with a weak reference whose callback uncounts it when the storage is freed), and
``UntypedStorage.resize_`` is wrapped while the tracker is active, because FSDP gathers and frees
its unsharded parameters by resizing storages in place, which no op reports.

What a storage holds is known only later (a gradient is an activation-sized buffer until FSDP
hands it to ``param.grad``), so the tracker keeps a log of ``(storage, +-bytes)`` events and a
label per storage that :meth:`MemoryTracker.label` may revise until the end; :meth:`profile`
replays the log with the final labels. A storage's first label is its phase's default
(``PHASE_DEFAULTS``), or ``comm_buffers`` when a collective or FSDP's copy-in made it.

Two figures have no op behind them and are not counted: the inputs the loader made outside the
fake mode (a few integer tensors), and memory inside kernels (workspaces).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallelisms.torch_private import fsdp
from parallelisms.torch_private.fake import (
    LOCAL_SCALAR,
    FakeTensor,
    TorchDispatchMode,
    in_backward,
    is_traceable_wrapper_subclass,
    observing_storage_resizes,
)

CATEGORIES = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "unsharded_params",
    "comm_buffers",
    "buffers",
    "temporaries",
)
"""What a byte may be counted as; ``unsharded_params`` are FSDP's gathered parameters."""
PHASE_DEFAULTS = {
    "init": "temporaries",
    "forward": "activations",
    "backward": "activations",
    "finalize": "temporaries",
    "optimizer": "temporaries",
}
COMM_NAMESPACES = ("fsdp", "c10d", "_c10d_functional")
"""Ops whose outputs are communication buffers (FSDP's copy-in and the collectives)."""
_DEVICE = torch.ops.prim.device.default
"""``tensor.device``, which comes through the mode too: half the ops of a traced step, none
making a tensor or costing time."""
Observer = Callable[[Any, tuple, dict, Any], None]
"""Told every op: ``(func, args, kwargs, outputs)`` (the cost model's FLOP and byte counts)."""


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of them): what
    ``tree_flatten`` finds, without its cost, which every traced op would pay."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: a DTensor's local tensor's, a plain tensor's own."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for i in inner if isinstance(i, torch.Tensor) for s in storages(i)]
    return [t.untyped_storage()]


@dataclass
class PhasePeak:
    step: int
    phase: str
    peak_bytes: int
    end_bytes: int


@dataclass
class MemoryProfile:
    """What the replayed log says: the peak, its phase and its parts, and each part's own maximum."""

    peak_bytes: int
    peak_step: int
    peak_phase: str
    at_peak: dict[str, int]
    """Live bytes of each category at the peak."""
    largest: dict[str, int]
    """Each category's own largest live bytes over the run (the full gradient, the optimizer's
    state once created)."""
    phases: list[PhasePeak] = field(default_factory=list)


class MemoryTracker(TorchDispatchMode):
    """Counts storages as ops create them (see the module docstring); ``observers`` see every op."""

    def __init__(self, observers: Iterable[Observer] = ()):
        super().__init__()
        self.observers = list(observers)
        self.step = 0
        self.phase = "init"
        self.stepping = False
        """Inside a step's forward and backward: the phase follows autograd's engine."""
        self.scalar = 1
        """What reading a fake tensor's value returns (``.item()``, ``.tolist()``): fake tensors
        hold no values, and the trainer's step decision reads a token count and a norm."""
        self._next_key = 0
        self._keys: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self._events: list[tuple[int, int]] = []
        self._marks: list[tuple[int, int, str]] = [(0, 0, "init")]
        self._resizes: contextlib.AbstractContextManager[None] | None = None

    # ------------------------------------------------------------------ recording

    def set_phase(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if (self.step, phase) != self._marks[-1][1:]:
            self._marks.append((len(self._events), self.step, phase))
        self.phase = phase

    def __enter__(self) -> MemoryTracker:
        self._resizes = observing_storage_resizes(lambda storage: self._track(storage, self._default_label()))
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._resizes is not None:
            self._resizes.__exit__(None, None, None)
            self._resizes = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _DEVICE:
            return func(*args, **kwargs)
        if func is LOCAL_SCALAR and isinstance(args[0], FakeTensor):
            return self.scalar
        if self.stepping:
            phase = "backward" if in_backward() else "forward"
            if phase != self.phase:
                self.set_phase(phase)
        out = func(*args, **kwargs)
        if not func.is_view:  # a view's storage is its base's
            label = "comm_buffers" if func.namespace in COMM_NAMESPACES else self._default_label()
            for t in tensors_in(out):
                for storage in storages(t):
                    self._track(storage, label)
        for observer in self.observers:
            observer(func, args, kwargs, out)
        return out

    def _default_label(self) -> str:
        return PHASE_DEFAULTS[self.phase]

    def _track(self, storage: torch.UntypedStorage, label: str) -> None:
        """Count a new storage, or a size change of a known one."""
        ident = id(storage)
        key = self._keys.get(ident)
        size = storage.nbytes()
        if key is None:
            key = self._next_key
            self._next_key += 1
            self._keys[ident] = key
            self._refs[ident] = weakref.ref(storage, functools.partial(self._freed, ident))
            self._sizes[key] = 0
            self.labels[key] = label
        delta = size - self._sizes[key]
        if delta:
            self._sizes[key] = size
            self._events.append((key, delta))

    def _freed(self, ident: int, _: object = None) -> None:
        key = self._keys.pop(ident)
        del self._refs[ident]
        size = self._sizes.pop(key)
        if size:
            self._events.append((key, -size))

    def label(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Say what ``tensors``' storages hold (their label for the whole run)."""
        for t in tensors:
            if t is None:
                continue
            for storage in storages(t):
                key = self._keys.get(id(storage))
                if key is None:
                    self._track(storage, category)
                else:
                    self.labels[key] = category

    def live(self) -> dict[str, int]:
        """Bytes alive now, by category (with the labels known so far)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for key in self._keys.values():
            totals[self.labels[key]] += self._sizes[key]
        return totals

    def label_live(self, category: str, keep: Iterable[str]) -> None:
        """Label every live storage ``category`` except those already labelled one of ``keep``."""
        kept = set(keep)
        for key in self._keys.values():
            if self.labels[key] not in kept:
                self.labels[key] = category

    # ------------------------------------------------------------------ replay

    def profile(self) -> MemoryProfile:
        """Replay the log with the final labels: the peak with its phase and parts."""
        totals = dict.fromkeys(CATEGORIES, 0)
        largest = dict(totals)
        live = peak = 0
        at_peak, peak_phase = dict(totals), self._marks[0][1:]
        bounds = [m[0] for m in self._marks[1:]] + [len(self._events)]
        phases: dict[tuple[int, str], PhasePeak] = {}
        for (start, step, phase), end in zip(self._marks, bounds):
            stats = phases.setdefault((step, phase), PhasePeak(step, phase, live, live))
            for key, delta in self._events[start:end]:
                category = self.labels[key]
                totals[category] += delta
                live += delta
                largest[category] = max(largest[category], totals[category])
                stats.peak_bytes = max(stats.peak_bytes, live)
                if live > peak:
                    peak, at_peak, peak_phase = live, dict(totals), (step, phase)
            stats.end_bytes = live
        return MemoryProfile(peak, *peak_phase, at_peak, largest, list(phases.values()))


def label_training_state(tracker: MemoryTracker, modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """Label what ``modules`` and ``optimizer`` hold: parameters, gradients, optimizer state, and
    FSDP's unsharded parameters (gathered by resizing storages it keeps)."""
    params = [p for module in modules for p in module.parameters()]
    tracker.label(params, "params")
    tracker.label([p.grad for p in params], "grads")
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.label(state, "optimizer")
    for module in (m for root in modules for m in root.modules()):
        for fsdp_param in fsdp.group_params(module):
            unsharded_params, unsharded_grads = fsdp.unsharded_buffers(fsdp_param)
            tracker.label(unsharded_params, "unsharded_params")
            # Gradients FSDP holds unsharded until it reduces them (under PP, the step's last backward).
            tracker.label(unsharded_grads, "grads")
