"""Compare two checkpoints entry by entry, tensors bit for bit, and say which kinds of state differ.

Usage: ``python scripts/compare_checkpoints.py CHECKPOINT_A CHECKPOINT_B``

Each argument is a ``torch.distributed.checkpoint`` folder (``{dump_folder}/checkpoint/step-N``),
saved on any mesh. Every tensor entry (weights, optimizer moments, step counters, the RNG state)
is compared by its bits, so ``-0.0`` against ``0.0`` or two different NaNs count as different;
every other entry (the optimizer's hyperparameters, the LR schedule, the data loader's position,
the step) by value. Prints which kinds of state differ (model weights, optimizer state, RNG
state...) and which are the same, the first differing entry, and the largest absolute and
relative differences over the tensors: the question "why did these two runs diverge" starts
from what, where and by how much. Exit 0 when every entry is identical, 1 when any differs, 2
when an argument is not a checkpoint, 3 when one is damaged (a file missing, truncated or not
matching its checksum, its metadata unreadable): a damaged checkpoint is not a divergence. Runs in
one process without a process group; holds both checkpoints in memory.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from trainer.checkpoint.folders import checkpoint_problem  # noqa: E402
from trainer.checkpoint.integrity import METADATA_FILE, checksum_problem  # noqa: E402
from trainer.runtime.errors import UserError, report  # noqa: E402

KINDS = (
    ("model.", "model weights"),
    ("optimizer.", "optimizer state"),
    ("lr_scheduler.", "LR schedule"),
    ("dataloader.", "data loader position"),
    ("train_state.rng", "RNG state"),
    ("train_state.", "train state"),
)
"""What a checkpoint entry is part of, by the first prefix of its key that matches, in the
order the report lists them."""


class NotACheckpointError(UserError, ValueError):
    """An argument that is not a DCP checkpoint folder."""

    label = "not a checkpoint"


class DamagedCheckpointError(UserError, ValueError):
    """An argument whose checkpoint cannot be read whole."""

    label = "damaged checkpoint"
    exit_code = 3


def kind(key: str) -> str:
    """The kind of state an entry belongs to, as the report names it."""
    return next((name for prefix, name in KINDS if key.startswith(prefix)), key.split(".", 1)[0])


def read_entries(folder: Path) -> dict[str, Any]:
    """Every entry of the checkpoint at ``folder``: tensors whole and on the CPU, other values as saved."""
    if not (folder / METADATA_FILE).is_file():
        raise NotACheckpointError(
            f"{folder} has no torch.distributed.checkpoint metadata; pass a `{{dump_folder}}/checkpoint/step-N` folder."
        )
    problem = checkpoint_problem(folder) or checksum_problem(folder)
    if problem is not None:
        raise DamagedCheckpointError(f"{folder} cannot be compared: {problem}.")
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    entries: dict[str, Any] = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(entries, checkpoint_id=str(folder), no_dist=True)
        except Exception as error:  # what a damaged file raises depends on where it is damaged
            raise DamagedCheckpointError(
                f"{folder} cannot be compared: reading it failed ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[-1] if str(error).strip() else 'no message'})."
            ) from error
    return entries


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensor entries of the checkpoint at ``folder``."""
    return {key: value for key, value in read_entries(folder).items() if isinstance(value, torch.Tensor)}


@dataclass
class Comparison:
    compared: int = 0
    differing: list[str] = field(default_factory=list)
    """Keys whose entries differ (in type, dtype, shape, bits or value) or that only one
    checkpoint has, in key order."""
    reasons: dict[str, str] = field(default_factory=dict)
    largest_abs: tuple[float, str] = (0.0, "")
    largest_rel: tuple[float, str] = (0.0, "")
    entries: dict[str, int] = field(default_factory=dict)
    """How many entries each kind of state has, in either checkpoint."""

    def differing_kinds(self) -> dict[str, int]:
        """How many entries of each kind differ, for the kinds where any does."""
        counts = {name: 0 for name in self.entries}
        for key in self.differing:
            counts[kind(key)] += 1
        return {name: n for name, n in counts.items() if n}

    def only_in(self, name: str) -> str:
        """``", 4 only in A"``: how many of a kind's differing entries one checkpoint lacks."""
        sides = Counter(self.reasons[key] for key in self.differing if kind(key) == name)
        return "".join(f", {sides[f'only in {side}']} only in {side}" for side in "AB" if sides[f"only in {side}"])

    def summary(self) -> list[str]:
        """The report's ``differ:`` and ``identical:`` lines: a kind is identical as a whole, or
        in part (``model weights (51 of 55 entries)``) where some of its entries differ."""
        kinds = self.differing_kinds()
        differ = [f"{name} ({n} of {self.entries[name]} entries{self.only_in(name)})" for name, n in kinds.items()]
        same = [
            name
            if name not in kinds
            else f"{name} ({self.entries[name] - kinds[name]} of {self.entries[name]} entries)"
            for name in self.entries
            if kinds.get(name, 0) < self.entries[name]
        ]
        return [f"differ: {', '.join(differ)}", f"identical: {', '.join(same) or 'nothing'}"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    result = Comparison()
    order = [name for _, name in KINDS]
    keys = sorted(a.keys() | b.keys())
    counts = Counter(kind(key) for key in keys)
    for name in sorted(counts, key=lambda n: (order.index(n) if n in order else len(order), n)):
        result.entries[name] = counts[name]
    for key in keys:
        if key not in a or key not in b:
            result.differing.append(key)
            result.reasons[key] = f"only in {'A' if key in a else 'B'}"
            continue
        result.compared += 1
        reason = _difference(a[key], b[key], key, result)
        if reason is not None:
            result.differing.append(key)
            result.reasons[key] = reason
    return result


def _difference(x: Any, y: Any, key: str, result: Comparison) -> str | None:
    """Why two entries differ, or None; a tensor's largest differences are recorded in ``result``."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None if type(x) is type(y) and x == y else f"{x!r} in A, {y!r} in B"
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{x.dtype} {tuple(x.shape)} in A, {y.dtype} {tuple(y.shape)} in B"
    if torch.equal(_bytes(x), _bytes(y)):
        return None
    diff = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
    scale = torch.maximum(x.double().abs(), y.double().abs())
    rel = torch.where(scale > 0, diff / scale, diff).nan_to_num(nan=float("inf"))
    worst_abs, worst_rel = diff.max().item(), rel.max().item()
    if worst_abs >= result.largest_abs[0]:
        result.largest_abs = (worst_abs, key)
    if worst_rel >= result.largest_rel[0]:
        result.largest_rel = (worst_rel, key)
    return f"bits differ (largest absolute difference {worst_abs:.3e}, relative {worst_rel:.3e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="a checkpoint folder (.../checkpoint/step-N)")
    parser.add_argument("b", type=Path, help="another checkpoint folder")
    opts = parser.parse_args(argv)
    try:
        a, b = read_entries(opts.a), read_entries(opts.b)
    except UserError as err:
        return report(err, program="compare_checkpoints")
    result = compare(a, b)
    if not result.differing:
        tensors = [t for t in a.values() if isinstance(t, torch.Tensor)]
        print(
            f"identical: {len(tensors)} tensors, {sum(t.numel() for t in tensors):,} elements, "
            f"and {len(a) - len(tensors)} other entries ({', '.join(result.entries)})"
        )
        return 0
    print(f"{len(result.differing)} of {len(a.keys() | b.keys())} entries differ")
    print("\n".join(result.summary()))
    first = result.differing[0]
    print(f"first differing entry: {first}: {result.reasons[first]}")
    if result.largest_abs[1]:
        print(f"largest absolute difference: {result.largest_abs[0]:.6e} in {result.largest_abs[1]}")
        print(f"largest relative difference: {result.largest_rel[0]:.6e} in {result.largest_rel[1]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
