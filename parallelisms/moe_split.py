"""Where an MoE layer's time goes: the router, the dispatch, the expert matmuls, the combine.

Each part runs inside a ``record_function`` range ``moe/<part>``, so a profiler trace shows it on
every layer; under expert parallelism the dispatch and the combine are the token all-to-alls
(``expert_parallel.py``), without it the permutations that sort the tokens by expert and back.
The parts never nest, so their times add up. While ``SPLIT`` measures (the run's first timed
steps, for the start report), each part's wall-clock time is also summed, the device
synchronised at its edges so that a kernel counts in the part that launched it; otherwise nothing
is timed or synchronised, and without a profiler recording no range is opened (a range costs
microseconds). One ``SPLIT`` per process: every MoE layer of the rank adds to it, a
checkpointed block's recomputation too. Opening ranges in the forward and not in the
recomputation (or the other way round) is safe under every checkpointing mode: op-level
checkpointing matches only the ops it keeps (``activation_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from parallelisms.torch_private import kernels

PARTS = ("router", "dispatch", "experts", "combine")


class MoESplit:
    """Seconds per part, summed over the layers and forwards between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.measuring = False
        self.naming = False
        """Set by ``--simulate``: :attr:`current` names the part running, so that its bytes are
        attributed to it (no range, no timing)."""
        self.current: str | None = None
        self._sync: Callable[[], None] = lambda: None

    def start(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        self.measuring = True

    def stop(self) -> dict[str, float]:
        self.measuring = False
        return dict(self.seconds)

    def part(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The part's range while a profiler records, timed while measuring; otherwise nothing.
        Nothing in compiled code either: compile fuses across the parts, so they have no time of
        their own there, and the profiler check would break the block's graph."""
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        if self.measuring or kernels.profiler_enabled():
            return self._ranged(name)
        if self.naming:
            return self._named(name)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _named(self, name: str) -> Iterator[None]:
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer

    @contextlib.contextmanager
    def _ranged(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"moe/{name}"):
            if not self.measuring:
                yield
                return
            self._sync()
            begin = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self.seconds[name] += time.perf_counter() - begin


SPLIT = MoESplit()
