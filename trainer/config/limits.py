"""A numeric field's limits, declared once in the schema beside its doc: ``validate`` checks every
field from them with one message shape, and ``--help`` shows them, so the range a key accepts is
written in one place."""

from __future__ import annotations

from dataclasses import dataclass

Number = int | float

MAX_LR = 10.0  # far above any useful LR; 1e20 makes every step non-finite (skipped), 1e38 overflows AdamW
MAX_WEIGHT_DECAY = 10.0  # each step scales matrices by 1 - lr x weight_decay: larger is a typo zeroing them
MAX_SEQ_LEN = 1_048_576  # 2**20: longer fits no device; a typo would otherwise fail deep inside the model
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600  # a collective waiting a week is a hang; far more overflows timedelta
MAX_SEED = 2**63 - 1  # TOML's largest integer, so the saved config.toml reads back
# A float32 routing bias this large is spaced 2 apart: adding a router score in [0, 1] to it
# changes nothing, so no step could route by the router any more (1e300 overflows to NaN).
MAX_BIAS_UPDATE_RATE = float(2**24)
# The balancing loss's gradient is scaled by weight x the step's tokens in float32 (at most
# 3.4e38): 1e9 leaves room for 1e20 tokens a step, and is 1e11 times the usual 0.01.
MAX_BALANCE_LOSS_WEIGHT = 1e9
# Each chunk of an MoE layer's exchanged tokens is a grouped matmul and a weight gradient of its
# own: past a few, more chunks hide no more communication and add launches and gradient adds.
MAX_OVERLAP_CHUNKS = 16


@dataclass(frozen=True)
class Limits:
    """Bounds (``ge``/``gt`` below, ``le``/``lt`` above; None: unbounded) for a number, or for each
    item of a list; ``allowed`` holds sentinels outside the range, such as -1 meaning "auto"."""

    ge: Number | None = None
    gt: Number | None = None
    le: Number | None = None
    lt: Number | None = None
    allowed: tuple[Number, ...] = ()

    def admits(self, value: Number) -> bool:
        if value in self.allowed:
            return True
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        """``>= 1``, ``in [0, 1)``, ``> 0``, followed by ``, or -1`` for each sentinel."""
        low = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        high = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        if low and high:
            opening, closing = "[" if low[0] == ">=" else "(", "]" if high[0] == "<=" else ")"
            text = f"in {opening}{_number(low[1])}, {_number(high[1])}{closing}"
        else:
            operator, bound = low or high or ("any number", None)
            text = operator if bound is None else f"{operator} {_number(bound)}"
        return text + "".join(f", or {_number(value)}" for value in self.allowed)


def _number(value: Number) -> str:
    """``1`` rather than ``1.0``, so a float key's message reads like an int key's."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
