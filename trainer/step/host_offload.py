"""Held forwards kept in host memory: exact MoE balancing without the pre-pass where the GPU
has no room for them.

Exact (``global_batch``) balancing under full checkpointing runs every micro-batch's forward
before any backward (``trainer/step/expert_balance.py``), so each micro-batch's block inputs and its
loss's saved tensors wait for the step's backwards: 12 GiB a GPU for the Qwen3-30B-A3B preset on
8 H100s, where the alternative is a counting pre-pass, a whole extra forward. :class:`HostOffload`
moves what a held forward saves for backward into pinned host memory as the forward makes it, on
a copy stream of its own, and brings a micro-batch's tensors back before its backward (the next
micro-batch's while this one's backward runs), so the GPU holds at most two micro-batches' worth.

What moves: the plain tensors a forward saves outside the checkpointed blocks' own recording,
that is each block's input (``torch.utils.checkpoint`` saves its inputs as saved tensors) and the
final hidden states or the loss's gradients, from ``MIN_BYTES`` up. Parameters stay (FSDP's
gathered weights are its to free) and so do tensor subclasses (DTensor shards, float8 weights).
The values come back bit for bit: the step's loss and gradients equal those held on the GPU.

On a CPU device the host is the device: every saved tensor outside the checkpointed blocks,
whatever its size, is copied to a storage of its own and back (:func:`host_offload`), which tests
the selection and the round trip but saves no memory (``moe.held_forwards = host`` is for GPUs;
``auto`` never chooses it on a CPU).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from parallelisms.torch_private.fake import is_traceable_wrapper_subclass

MIN_BYTES = 1 << 20
"""Smaller saved tensors (routing indices, norms' statistics) stay on the device: a copy of its own
each would cost more in launches than the memory they hold."""


@dataclass
class Held:
    """One saved tensor in host memory, and once :meth:`HostOffload.fetch` brought it back, its
    copy on the device (kept while autograd keeps this: every backward that saved it may read it)."""

    host: torch.Tensor
    fetched: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    """Recorded on the copy stream after the host-to-device copy (CUDA only)."""


class HostOffload:
    """Per step: :meth:`begin_step`, each held forward inside :meth:`saving`, then :meth:`fetch`
    before each micro-batch's backward."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device = device
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: dict[int, list[weakref.ref[Held]]] = {}
        """Per micro-batch, what it moved and no :meth:`fetch` has brought back yet, while autograd
        keeps it (what a backward already read, unannounced, is gone with it)."""
        self.moved_bytes = 0
        """Bytes sent to the host since the last :meth:`begin_step`."""

    def begin_step(self) -> None:
        self._pending.clear()
        self.moved_bytes = 0

    @contextlib.contextmanager
    def saving(self, microbatch: int) -> Iterator[None]:
        """Within it, what autograd saves for backward goes to host memory (see the module
        docstring), each tensor once however many ops save it (every block saves RoPE's table)."""
        pending = self._pending.setdefault(microbatch, [])
        moved: WeakIdKeyDictionary = WeakIdKeyDictionary()

        def pack(t: torch.Tensor) -> torch.Tensor | Held:
            if t in moved:
                return moved[t]
            if not self._moves(t):
                return t
            held = moved[t] = Held(self._to_host(t))
            pending.append(weakref.ref(held))
            self.moved_bytes += _nbytes(t)
            return held

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def fetch(self, microbatch: int) -> None:
        """Start bringing ``microbatch``'s tensors back to the device (on the copy stream); its
        backward waits for each only where it first uses it."""
        for ref in self._pending.pop(microbatch, []):
            held = ref()
            if held is not None:
                held.fetched, held.ready = self._copy_back(held.host)

    def _moves(self, t: torch.Tensor) -> bool:
        return (
            not is_traceable_wrapper_subclass(t)
            and not isinstance(t, nn.Parameter)
            and t.device == self.device
            and _nbytes(t) >= self.min_bytes
        )

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return t.detach().clone()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
        # The forward may free ``t`` before the copy has read it: the allocator waits for the stream.
        t.record_stream(self.stream)
        return host

    def _copy_back(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A device copy of ``host``, and the event the compute stream must wait for before reading it."""
        if self.stream is None:
            return host, None
        fetched = torch.empty_like(host, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fetched.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        fetched.record_stream(self.stream)
        return fetched, ready

    def _unpack(self, packed: torch.Tensor | Held) -> torch.Tensor:
        if not isinstance(packed, Held):
            return packed
        if packed.fetched is None:
            # Read before any fetch announced it (an inner graph of the forward, or a backward
            # run without ``fetch``): a copy for this read alone, which its reader frees.
            fetched, ready = self._copy_back(packed.host)
        else:
            fetched, ready = packed.fetched, packed.ready
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return fetched


def host_offload(device: torch.device) -> HostOffload:
    """The job's: on a CPU every saved tensor moves, so that small models test what a GPU's moves."""
    return HostOffload(device, MIN_BYTES if device.type != "cpu" else 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
