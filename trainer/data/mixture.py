"""Dataset mixtures: several datasets, each given a share of every global batch.

``training.dataset_path = ["data/web", "data/code"]`` with ``training.dataset_weights = [0.7,
0.3]`` trains on both. Which dataset fills each position of the global sample stream is a
function of the position and the weights only, so the mixture keeps the loader's promise: a
step's global batch depends on the step, the data, the global batch size and the seed, never on
the mesh, and a resume at any step costs O(1) (no replay of the steps before it).

**Which dataset.** Stream position ``p`` is given to the dataset whose share of ``[0, 1)`` holds
``u(p) = bitreverse(p mod 2^K) / 2^K`` (the van der Corput sequence, K = 24): every share
``[c_{d-1}, c_d)`` of ``[0, 1)`` gets a fraction of any run of consecutive positions that
differs from its weight by O(K / run length), so even an 8-sample global batch is mixed as
evenly as its size allows, and over each period of 2^K positions the proportions equal the
weights to 2^-K. The number of positions a dataset received before ``p`` has a closed form
(:meth:`MixtureOrder.counts`), which is what makes resume O(1).

**Which sample.** Each dataset is read in its own shuffled epochs (:class:`GlobalOrder` with a
seed of its own): its n-th position in the stream takes its n-th sample of that stream. A small
dataset with a large weight is therefore repeated more often (up-sampled), epoch by epoch.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Protocol

import torch
from torch.utils.data import Dataset

from trainer.data.loader import GlobalOrder

PERIOD_BITS = 24
_PERIOD = 1 << PERIOD_BITS
SEED_STRIDE = 1_000_003
"""Dataset d's epochs are seeded ``seed + SEED_STRIDE * (d + 1) + epoch``: distinct from each
other and from a single dataset's ``seed + epoch`` for any run shorter than a million epochs."""


def _bitreverse(value: int) -> int:
    return int(f"{value:0{PERIOD_BITS}b}"[::-1], 2)


def _thresholds(weights: Sequence[float]) -> list[int]:
    """Cumulative shares of ``[0, 2^K)``: dataset d owns ``[t[d], t[d + 1])``."""
    total = sum(weights)
    cumulative, out = 0.0, [0]
    for weight in weights[:-1]:
        cumulative += weight
        out.append(round(cumulative / total * _PERIOD))
    return out + [_PERIOD]


def _count_below(prefix: int, threshold: int) -> int:
    """``#{r < prefix : bitreverse(r) < threshold}`` for ``prefix <= 2^K``, in O(K).

    ``[0, prefix)`` splits into aligned blocks ``[a, a + 2^j)``, one per set bit j of ``prefix``;
    bit reversal maps such a block onto the progression ``bitreverse(a) + i * 2^(K - j)``,
    ``i < 2^j``, whose members below ``threshold`` are counted by one division.
    """
    count, start = 0, 0
    for j in reversed(range(PERIOD_BITS + 1)):
        size = 1 << j
        if prefix & size:
            base, stride = (_bitreverse(start) if start < _PERIOD else 0), _PERIOD >> j
            if threshold > base:
                count += min(size, -(-(threshold - base) // stride))
            start += size
    return count


class MixtureOrder:
    """The global sample stream of a mixture and its cut into global batches.

    Has :class:`GlobalOrder`'s interface (``batch(step)``, ``num_samples``,
    ``global_batch_size``, ``seed``); the indices it returns address :class:`MixtureDataset`,
    whose members are concatenated in order.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.num_samples = self.offsets[-1]
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._thresholds = _thresholds(weights)
        self._members = [GlobalOrder(size, 1, seed + SEED_STRIDE * (d + 1)) for d, size in enumerate(self.sizes)]

    def dataset_at(self, position: int) -> int:
        return bisect.bisect_right(self._thresholds, _bitreverse(position % _PERIOD)) - 1

    def counts(self, position: int) -> list[int]:
        """How many of the first ``position`` stream positions each dataset received."""
        periods, rest = divmod(position, _PERIOD)
        t = self._thresholds
        return [
            periods * (t[d + 1] - t[d]) + _count_below(rest, t[d + 1]) - _count_below(rest, t[d])
            for d in range(len(self.sizes))
        ]

    def batch(self, step: int) -> list[int]:
        """Mixture indices of step ``step``'s global batch, in global order."""
        start = step * self.global_batch_size
        seen = self.counts(start)
        indices = []
        for position in range(start, start + self.global_batch_size):
            d = self.dataset_at(position)
            indices.append(self.offsets[d] + self._members[d].stream(seen[d], 1)[0])
            seen[d] += 1
        return indices

    def shares(self, steps: int) -> list[float]:
        """Each dataset's realised share of the first ``steps`` global batches."""
        counts = self.counts(steps * self.global_batch_size)
        return [c / max(1, sum(counts)) for c in counts]


class Member(Protocol):
    """What a mixture needs of each of its datasets."""

    seq_len: int
    pad_id: int
    identity: dict[str, str]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class MixtureDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The members' samples, concatenated: index ``offsets[d] + i`` is member d's sample i."""

    def __init__(self, members: Sequence[Member], names: Sequence[str], weights: Sequence[float]) -> None:
        self.members = list(members)
        self.names = list(names)
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.offsets = [0]
        for member in self.members:
            self.offsets.append(self.offsets[-1] + len(member))
        self.seq_len = self.members[0].seq_len
        self.pad_id = self.members[0].pad_id
        data = hashlib.sha256()
        for member in self.members:
            data.update(member.identity["samples_sha256"].encode())
        # The weights decide the order of samples: a resume with other weights is other data, and
        # the identity's key names the setting to restore.
        self.identity = {
            "samples_sha256": data.hexdigest(),
            "tokenizer_sha256": self.members[0].identity["tokenizer_sha256"],
            "training.dataset_weights": ", ".join(f"{w:.6g}" for w in self.weights),
        }

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = bisect.bisect_right(self.offsets, index) - 1
        if not 0 <= d < len(self.members):
            raise IndexError(f"sample {index} out of range for a mixture of {len(self)} samples")
        return self.members[d][index - self.offsets[d]]

    def member_of(self, index: int) -> str:
        return self.names[bisect.bisect_right(self.offsets, index) - 1]

    def order(self, global_batch_size: int, seed: int) -> MixtureOrder:
        return MixtureOrder([len(m) for m in self.members], self.weights, global_batch_size, seed)

    def describe_shares(self, steps: int, global_batch_size: int, seed: int) -> str:
        shares = self.order(global_batch_size, seed).shares(steps)
        return ", ".join(
            f"{name} {share:.2%} (weight {weight:.2%}, {len(member):,} samples)"
            for name, share, weight, member in zip(self.names, shares, self.weights, self.members)
        )
