"""The device mesh: validated parallelism degrees and the named sub-meshes each part needs.

One ``DeviceMesh`` with dimensions ``(dp_replicate, dp_shard, cp, tp)`` (size-1 dimensions
included, so every sub-mesh exists on every run) is built once. The sub-meshes are:

- ``batch``: ``dp_replicate x dp_shard`` - ranks that read different samples;
- ``fsdp``: ``dp_shard x cp`` - ranks that shard parameters (CP ranks shard too: they hold the
  same parameters);
- ``loss``: ``dp_replicate x dp_shard x cp`` - every rank that holds different label tokens, the
  group over which valid tokens are counted (tensor-parallel ranks hold the same tokens);
- ``tp`` and ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ConfigError

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Merge ``dims`` of ``mesh`` into one dimension called ``name``.

    ``DeviceMesh._flatten`` is private API; this is the one place that calls it.
    """
    return mesh[dims]._flatten(name)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        named = {
            "parallelism.data_parallel_replicate_degree": self.dp_replicate,
            "parallelism.context_parallel_degree": self.cp,
            "parallelism.tensor_parallel_degree": self.tp,
        }
        for key, value in named.items():
            if value < 1:
                raise ConfigError(f"`{key}` must be >= 1, got {value}.")
        if self.dp_shard == -1 or self.dp_shard == 0:
            others = self.dp_replicate * self.cp * self.tp
            if self.world_size % others:
                raise ConfigError(
                    f"cannot infer `parallelism.data_parallel_shard_degree`: world size {self.world_size} "
                    f"is not divisible by replicate x cp x tp = {others}; change the degrees or the "
                    f"number of processes (NGPU)."
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ConfigError(
                f"`parallelism.data_parallel_shard_degree` must be >= 1 or -1 (infer), got {self.dp_shard}."
            )
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"mesh dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} = {product} does not match the world size {self.world_size}; set "
                f"`parallelism.data_parallel_shard_degree` to -1 to infer it, or launch "
                f"{product} processes (NGPU={product})."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> "Meshes":
        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        batch = flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
        fsdp = flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        loss = flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
        param = mesh["dp_replicate", "dp_shard_cp"] if self.hsdp else fsdp
        return Meshes(world=mesh, batch=batch, fsdp=fsdp, param=param, loss=loss, tp=mesh["tp"], cp=mesh["cp"])


@dataclass
class Meshes:
    """Named views of the one world mesh; ``param`` is the mesh FSDP shards over (2-D under HSDP)."""

    world: DeviceMesh
    batch: DeviceMesh
    fsdp: DeviceMesh
    param: DeviceMesh
    loss: DeviceMesh
    tp: DeviceMesh
    cp: DeviceMesh


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
