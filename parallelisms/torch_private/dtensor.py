"""DeviceMesh, DTensor and tensor/context-parallel internals.

Mesh flattening (one data-parallel dimension out of several), FSDP's strided shards (which Muon's
exchange undoes), the box of a global tensor a rank
holds, the TP styles' output hook (overridden by ``parallelisms/tensor_parallel.py``), the ring
attention's rotation setting, functional collectives' all-to-alls (even with autograd: Ulysses and
expert parallelism's counts; uneven and un-waited: expert parallelism's tokens), and a DTensor's
local tensor as the simulator's dispatch mode sees it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

FEATURE = "the device mesh, tensor and context parallelism"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = (
    "_StridedShard",
    "_flatten",
    "_utils",
    "compute_local_shape_and_global_offset",
    "_prepare_output_fn",
    "_attention",
    "set_rotate_method",
    "_functional_collectives",
    "_c10d_functional",
    "_local_tensor",
)


def split_dim(placement: Placement) -> int | None:
    """The tensor dimension ``placement`` splits (a shard, or FSDP's strided shard of a tensor TP
    shards too, which not every torch counts as a ``Shard``); None where it splits none."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def is_strided(placement: Placement) -> bool:
    """FSDP's shard of a TP shard: applied after the plain shards of its dimension."""
    return isinstance(placement, _StridedShard)


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Merge ``dims`` of ``mesh`` into one dimension called ``name``."""
    return mesh[dims]._flatten(name)


def local_shape_and_offset(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, offset)`` of the box of ``param``'s global tensor that this rank holds."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def rowwise_output(output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any) -> Any:
    """What ``RowwiseParallel`` does to a module's output."""
    return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def colwise_output(output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any) -> Any:
    """What ``ColwiseParallel`` does to a module's output."""
    return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def set_ring_rotation(method: str) -> None:
    """How torch's ring attention passes key/value shards: ``"allgather"`` or ``"alltoall"``."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(method)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block ``i`` of ``x``'s first dimension goes to rank ``i``; block ``i`` of the result came
    from it. Gradients route back. Waited for at once: the callers need the whole result, and an
    un-waited collective tensor that only a view consumes is still in flight at process exit."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


def start_all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows ``input_splits[i]`` of ``x`` (in order) go to rank ``i``; the result holds
    ``output_splits[i]`` rows from rank ``i``. No autograd and no wait: the result is being
    written until :func:`wait` (``parallelisms/async_exchange.py`` gives it its gradient; expert
    parallelism's token exchange)."""
    op = torch.ops._c10d_functional.all_to_all_single
    return op(x.contiguous(), output_splits, input_splits, group.group_name)


def wait(x: torch.Tensor) -> torch.Tensor:
    """``x`` once the collective writing it is done (no op when none is)."""
    return torch.ops._c10d_functional.wait_tensor(x)


def local_tensor(t: DTensor) -> torch.Tensor:
    """``t``'s local tensor, without dispatching an op (``to_local`` would, inside a dispatch mode)."""
    return t._local_tensor
