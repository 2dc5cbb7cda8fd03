"""A fence between a background copy of the training state and the optimizer step that would
change it under the copy: ``async_with_pinned_mem`` stages a checkpoint into pinned host memory
while the next step's forward and backward run, and the optimizer waits for that copy."""

from __future__ import annotations

from concurrent.futures import Future


class WeightsFence:
    def __init__(self) -> None:
        self._copying: Future | None = None

    def hold(self, copying: Future) -> None:
        """The state is being copied until ``copying`` is done."""
        self._copying = copying

    def wait(self) -> None:
        """Until the copy is done (its error, a bug, raises here)."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.result()
