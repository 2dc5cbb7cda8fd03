"""Sums whose order is fixed by the data, not by the machine: the layout-invariant mode's arithmetic.

Float addition is not associative, so the bits of a sum depend on its order. These add a stream
or a row by a tree that depends only on how many values there are (``debug.layout_invariant``:
``layout_invariant.py`` for the gradients, ``sums.py`` for the step's logged values).
"""

from __future__ import annotations

import torch


class PairwiseSum:
    """A running sum over a stream whose tree depends only on how many values came, not on when.

    A binary counter: equal-sized partial sums merge as soon as a second one arrives, so at most
    ``log2(n) + 1`` buffers are alive and the result is the pairwise sum ``(x0 + x1) + (x2 + x3)``
    ... of the stream, folded right to left at the end when ``n`` is not a power of two.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def add(self, x: torch.Tensor) -> None:
        """Add the next value of the stream (not kept: it is copied when it must be)."""
        size = 1
        while self._stack and self._stack[-1][0] == size:
            _, left = self._stack.pop()
            x = left.add_(x)
            size *= 2
        self._stack.append((size, x.clone() if size == 1 else x))

    def total(self) -> torch.Tensor:
        if not self._stack:
            raise RuntimeError("PairwiseSum.total() of an empty stream")
        _, acc = self._stack.pop()
        while self._stack:
            _, left = self._stack.pop()
            acc = left.add_(acc)
        return acc


def pairwise_rows(x: torch.Tensor) -> torch.Tensor:
    """The sums of the rows of a 2-D tensor, each added by a tree fixed by the row length only.

    Elementwise adds of the row halves (column ``j`` with ``j + n // 2``, an odd last column
    carried over), so a row's sum does not depend on how many rows there are or where the row
    lies in memory, which a reduction kernel's blocking does not promise.
    """
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0])
    while x.shape[1] > 1:
        n, half = x.shape[1], x.shape[1] // 2
        head = x[:, :half] + x[:, half : 2 * half]
        x = torch.cat([head, x[:, 2 * half :]], dim=1) if n % 2 else head
    return x[:, 0]
