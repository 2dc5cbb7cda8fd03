"""The device mesh: validated parallelism degrees and the named sub-meshes each part needs.

One ``DeviceMesh`` with dimensions ``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 dimensions
included, so every sub-mesh exists on every run) is built once. Pipeline parallelism is the
outermost dimension: its point-to-point traffic is the lightest, so it is the one that crosses
hosts, while tensor parallelism (innermost) stays on the fastest links. The sub-meshes are:

- ``batch``: ``dp_replicate x dp_shard`` - ranks that read different samples;
- ``fsdp``: what ``fully_shard`` shards over - ``dp_shard x cp`` flattened (CP ranks hold the
  same parameters, so they shard them too), with ``dp_replicate`` in front under HSDP (2-D);
- ``loss``: ``dp_replicate x dp_shard x cp`` - every rank that holds different label tokens, the
  group over which valid tokens are counted (tensor-parallel ranks hold the same tokens);
- ``stats``: ``pp x loss`` - where the logged loss statistics are reduced: only the last
  pipeline stage computes a loss, so its sum and maximum travel over the stages too (the token
  count, which every stage knows, does not);
- ``pp``, ``tp`` and ``cp``;
- with expert parallelism, ``ep`` (``ep`` consecutive ``dp_shard`` ranks, which split the routed
  experts) and ``expert_fsdp``: what shards the experts further, the ``dp_shard / ep`` ranks
  outside the EP group (with ``dp_replicate`` in front under HSDP). They come from a second mesh
  over the same ranks whose ``dp_shard`` dimension is cut in two, so the world mesh is unchanged;
  ``expert_checkpoint`` orders those ranks as the experts are, ``ep`` outside (a checkpoint's
  global view of the experts, ``trainer/checkpoint/expert_shards.py``).

This package knows nothing of the trainer's configuration. Its errors are
:class:`ParallelismError` templates that name the *settings* (``{tp}``, ``{seq_len}``); the
config layer renders them with its own key names, so a user reads
``parallelism.tensor_parallel_degree`` where this code says ``tp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallelisms.torch_private import dtensor

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelismError(ValueError):
    """A parallelism setting that cannot work, with what to do instead.

    The message is a ``str.format`` template whose fields are setting names (``{tp}``);
    ``str(error)`` shows the names themselves, :meth:`render` shows the caller's names for them.
    """

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.render({}))

    def render(self, names: Mapping[str, str]) -> str:
        return self.template.format_map(_NameOrSelf(names))


class _NameOrSelf(dict):
    def __missing__(self, key: str) -> str:
        return key


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Merge ``dims`` of ``mesh`` into one dimension called ``name`` (private torch API)."""
    return dtensor.flatten_mesh(mesh, dims, name)


@dataclass
class ParallelDims:
    """The mesh shape: ``dp_shard = -1`` (or 0) is inferred from the world size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    pp: int = 1
    ep: int = 1
    """Expert-parallel degree, taken from the ``dp_shard`` ranks."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "cp", "tp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ParallelismError(f"{{{name}}} must be >= 1, got {value}.")
        if self.dp_shard in (-1, 0):
            others = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % others:
                raise ParallelismError(
                    f"cannot infer {{dp_shard}}: world size {self.world_size} is not divisible by "
                    f"pp x replicate x cp x tp = {others}; change the degrees or the number of processes (NGPU)."
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ParallelismError(f"{{dp_shard}} must be >= 1 or -1 (infer), got {self.dp_shard}.")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ParallelismError(
                f"mesh pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} = {product} does not match the world size {self.world_size}; set "
                f"{{dp_shard}} to -1 to infer it, or launch {product} processes (NGPU={product})."
            )
        if self.dp_shard % self.ep:
            raise ParallelismError(
                f"{{ep}} = {self.ep} must divide {{dp_shard}} = {self.dp_shard}: expert parallelism takes its "
                f"ranks from the data-parallel shard ranks; choose an ep that divides it."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> Meshes:
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        batch = flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
        shard = flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        loss = flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
        stats = flatten_mesh(mesh, ("pp", "dp_replicate", "dp_shard", "cp"), "pp_dp_cp")
        fsdp = mesh["dp_replicate", "dp_shard_cp"] if self.hsdp else shard
        meshes = Meshes(batch=batch, fsdp=fsdp, loss=loss, tp=mesh["tp"], cp=mesh["cp"], pp=mesh["pp"], stats=stats)
        if self.ep > 1:
            names = ("pp", "dp_replicate", "dp_shard_out_ep", "ep", "cp", "tp")
            shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)
            expert_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            meshes.ep = expert_mesh["ep"]
            meshes.expert_fsdp = (
                expert_mesh["dp_replicate", "dp_shard_out_ep"] if self.hsdp else expert_mesh["dp_shard_out_ep"]
            )
            # The same ranks with ``ep`` outside ``dp_shard_out_ep``: the order of the experts.
            ranks = expert_mesh.mesh.transpose(2, 3)
            names = ("pp", "dp_replicate", "ep", "dp_shard_out_ep", "cp", "tp")
            global_order = DeviceMesh(device_type, ranks, mesh_dim_names=names)
            meshes.expert_checkpoint = global_order["dp_replicate", "ep", "dp_shard_out_ep"]
        return meshes


@dataclass
class Meshes:
    """Named views of the one world mesh (see the module docstring)."""

    batch: DeviceMesh
    fsdp: DeviceMesh
    loss: DeviceMesh
    tp: DeviceMesh
    cp: DeviceMesh
    pp: DeviceMesh
    stats: DeviceMesh
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
    expert_checkpoint: DeviceMesh | None = None

    def groups(self) -> list[ProcessGroup]:
        """Every process group of these meshes (for settings that apply per group, like timeouts)."""
        found: dict[int, ProcessGroup] = {}
        optional = [m for m in (self.ep, self.expert_fsdp) if m is not None]
        for mesh in (self.batch, self.fsdp, self.loss, self.tp, self.cp, self.pp, self.stats, *optional):
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                found[id(group)] = group
        return list(found.values())


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
