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
- ``routing``: ``loss x tp`` - every rank that routes different tokens through the experts
  (a tensor-parallel rank routes its own sequence shard), where the MoE routing is counted;
  the loss mesh itself without tensor parallelism;
- ``replicated_fsdp``: ``fsdp`` with ``tp`` folded into its shard dimension, for parameters that
  are replicated over TP ranks which feed them different tokens (an MoE layer's router and
  shared experts): sharding them there sums their gradients over TP as well; ``fsdp`` itself
  without tensor parallelism;
- with expert parallelism, ``ep`` (``ep`` consecutive ranks of ``dp_shard x cp``, which split the
  routed experts, as torchtitan takes them) and ``expert_fsdp``: what shards the experts further,
  the other ``dp_shard x cp / ep`` ranks times ``tp`` (experts are not tensor-parallel; every TP
  rank sends its own tokens, so their gradients sum over TP too), with ``dp_replicate`` in front
  under HSDP. They come from a second mesh over the same ranks, ``(pp, dp_replicate, ep,
  expert_shard)``, so the world mesh is unchanged; ``expert_checkpoint`` is its
  ``(dp_replicate, ep, expert_shard)``: the experts split over ``ep`` first, then as FSDP splits
  them (a checkpoint's global view, ``trainer/checkpoint/expert_shards.py``).

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
EXPERT_MESH_DIM_NAMES = ("pp", "dp_replicate", "ep", "expert_shard")


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
    """Expert-parallel degree, taken from the ``dp_shard x cp`` ranks."""

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
        if (self.dp_shard * self.cp) % self.ep:
            raise ParallelismError(
                f"{{ep}} = {self.ep} must divide {{dp_shard}} x {{cp}} = {self.dp_shard} x {self.cp}: expert "
                f"parallelism takes its ranks from the data-parallel shard and context-parallel ranks; choose an "
                f"ep that divides {self.dp_shard * self.cp}."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_one_rank(self) -> bool:
        """FSDP over one rank, outside pipeline stages: its gathers and reductions are only
        copies and casts, so the trainer keeps the parameters gathered and the gradients
        unsharded through the step, casting and reducing once a step, not per micro-batch."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp == 1

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
        routing, replicated_fsdp = loss, fsdp
        if self.tp > 1:
            routing = flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp", "tp"), "dp_cp_tp")
            replicated = flatten_mesh(mesh, ("dp_shard", "cp", "tp"), "dp_shard_cp_tp")
            replicated_fsdp = mesh["dp_replicate", "dp_shard_cp_tp"] if self.hsdp else replicated
        meshes = Meshes(
            batch=batch,
            fsdp=fsdp,
            loss=loss,
            tp=mesh["tp"],
            cp=mesh["cp"],
            pp=mesh["pp"],
            stats=stats,
            routing=routing,
            replicated_fsdp=replicated_fsdp,
        )
        if self.ep > 1:
            ranks, names = expert_rank_grid(mesh.mesh, self)
            expert_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
            meshes.ep = expert_mesh["ep"]
            meshes.expert_fsdp = (
                expert_mesh["dp_replicate", "expert_shard"] if self.hsdp else expert_mesh["expert_shard"]
            )
            meshes.expert_checkpoint = expert_mesh["dp_replicate", "ep", "expert_shard"]
        return meshes


def expert_rank_grid(ranks: torch.Tensor, dims: ParallelDims) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The world mesh's ranks ``(pp, dp_replicate, dp_shard, cp, tp)`` regrouped for the experts as
    ``(pp, dp_replicate, ep, expert_shard)``: ``dp_shard x cp`` is cut into the ranks outside the
    EP group and ``ep`` consecutive ones, and ``expert_shard`` is those outside ranks times ``tp``."""
    outside = dims.dp_shard * dims.cp // dims.ep
    grid = ranks.reshape(dims.pp, dims.dp_replicate, outside, dims.ep, dims.tp).permute(0, 1, 3, 2, 4)
    return grid.reshape(dims.pp, dims.dp_replicate, dims.ep, outside * dims.tp), EXPERT_MESH_DIM_NAMES


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
    routing: DeviceMesh
    replicated_fsdp: DeviceMesh
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
    expert_checkpoint: DeviceMesh | None = None

    def groups(self) -> list[ProcessGroup]:
        """Every process group of these meshes (for settings that apply per group, like timeouts)."""
        found: dict[int, ProcessGroup] = {}
        optional = [m for m in (self.ep, self.expert_fsdp) if m is not None]
        every = [self.batch, self.fsdp, self.loss, self.tp, self.cp, self.pp, self.stats, self.routing]
        for mesh in (*every, self.replicated_fsdp, *optional):
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                found[id(group)] = group
        return list(found.values())


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
