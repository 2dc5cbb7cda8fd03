"""Compare two checkpoints tensor by tensor, bit for bit.

Usage: ``python scripts/compare_checkpoints.py CHECKPOINT_A CHECKPOINT_B``

Each argument is a ``torch.distributed.checkpoint`` folder (``{dump_folder}/checkpoint/step-N``),
saved on any mesh. Every tensor entry (weights, optimizer moments, step counters) is compared by
its bits, so ``-0.0`` against ``0.0`` or two different NaNs count as different; non-tensor
entries (data loader and schedule state) are not compared. Prints the first differing tensor
and the largest absolute and relative differences over all of them: the question "why did these
two runs diverge" starts from where and by how much. Exit 0 when every tensor is identical,
1 when any differs, 2 when an argument is not a checkpoint. Runs in one process without a process
group; holds both checkpoints in memory.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from trainer.runtime.errors import UserError, report  # noqa: E402


class NotACheckpointError(UserError, ValueError):
    """An argument that is not a DCP checkpoint folder."""

    label = "not a checkpoint"


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor entry of the checkpoint at ``folder``, whole, on the CPU."""
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (FileNotFoundError, NotADirectoryError):
        raise NotACheckpointError(
            f"{folder} has no torch.distributed.checkpoint metadata; pass a `{{dump_folder}}/checkpoint/step-N` folder."
        ) from None
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    return tensors


@dataclass
class Comparison:
    compared: int = 0
    differing: list[str] = field(default_factory=list)
    """Keys whose tensors differ (in dtype, shape or bits) or that only one checkpoint has, in key order."""
    reasons: dict[str, str] = field(default_factory=dict)
    largest_abs: tuple[float, str] = (0.0, "")
    largest_rel: tuple[float, str] = (0.0, "")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Comparison:
    result = Comparison()
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            result.differing.append(key)
            result.reasons[key] = f"only in {'A' if key in a else 'B'}"
            continue
        x, y = a[key], b[key]
        result.compared += 1
        if x.dtype != y.dtype or x.shape != y.shape:
            result.differing.append(key)
            result.reasons[key] = f"{x.dtype} {tuple(x.shape)} in A, {y.dtype} {tuple(y.shape)} in B"
            continue
        if torch.equal(_bytes(x), _bytes(y)):
            continue
        diff = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
        scale = torch.maximum(x.double().abs(), y.double().abs())
        rel = torch.where(scale > 0, diff / scale, diff).nan_to_num(nan=float("inf"))
        worst_abs, worst_rel = diff.max().item(), rel.max().item()
        result.differing.append(key)
        result.reasons[key] = f"bits differ (largest absolute difference {worst_abs:.3e}, relative {worst_rel:.3e})"
        if worst_abs >= result.largest_abs[0]:
            result.largest_abs = (worst_abs, key)
        if worst_rel >= result.largest_rel[0]:
            result.largest_rel = (worst_rel, key)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="a checkpoint folder (.../checkpoint/step-N)")
    parser.add_argument("b", type=Path, help="another checkpoint folder")
    opts = parser.parse_args(argv)
    try:
        a, b = read_tensors(opts.a), read_tensors(opts.b)
    except UserError as err:
        return report(err, program="compare_checkpoints")
    result = compare(a, b)
    if not result.differing:
        print(f"identical: {result.compared} tensors, {sum(t.numel() for t in a.values()):,} elements")
        return 0
    first = result.differing[0]
    print(f"{len(result.differing)} of {len(a.keys() | b.keys())} tensors differ")
    print(f"first differing tensor: {first}: {result.reasons[first]}")
    if result.largest_abs[1]:
        print(f"largest absolute difference: {result.largest_abs[0]:.6e} in {result.largest_abs[1]}")
        print(f"largest relative difference: {result.largest_rel[0]:.6e} in {result.largest_rel[1]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
