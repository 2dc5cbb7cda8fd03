"""Expert-parallel weights saved as global tensors, so that a checkpoint resumes on any EP degree.

Under expert parallelism a rank's expert stack holds its ``n_experts / ep`` experts, FSDP-sharded
over the ranks outside the EP group (and the TP ranks): a DTensor whose global shape is the EP rank's
slice, so every EP rank would save a different tensor under one name. DCP reshards only what
carries its global place, so the save views each shard on the mesh ``(dp_replicate, ep,
expert_shard)`` (``Meshes.expert_checkpoint``) as (Replicate, Shard(0), Shard(0)): the experts
split over ``ep`` first, then each slice as FSDP splits it (``torch.chunk`` both), with the
global shape ``(n_experts, ...)`` of the un-split stack an ep = 1 run saves. The views share the
shards' storage, so a load writes into them and they go back to ``set_*_state_dict`` in FSDP's
own form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

# Module names that wrappers add to parameter names and that state-dict keys leave out.
WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod"}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").stride())


class ExpertShards:
    """The model's expert-parallel parameters by state-dict name, and their global views."""

    def __init__(self, model: nn.Module):
        self.meshes: dict[str, tuple[DeviceMesh, int]] = {}
        for name, module in model.named_modules():
            mesh = getattr(module, "checkpoint_mesh", None)
            if mesh is None:
                continue
            prefix = ".".join(part for part in name.split(".") if part not in WRAPPERS)
            for param_name, _ in module.named_parameters(recurse=False):
                self.meshes[f"{prefix}.{param_name}"] = (mesh, module.n_experts)
        self._fsdp_form: dict[str, tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]] = {}

    def to_global(self, state: dict[str, Any], fqn_of: Callable[[str], str]) -> dict[str, Any]:
        """``state`` with each expert shard viewed in the global stack (remembers FSDP's form)."""
        if not self.meshes:
            return state
        out = dict(state)
        for key, value in state.items():
            found = self.meshes.get(fqn_of(key))
            if found is None or not isinstance(value, DTensor):
                continue
            mesh, n_experts = found
            self._fsdp_form[key] = (value.device_mesh, tuple(value.placements), value.shape, value.stride())
            shape = (n_experts, *value.shape[1:])
            out[key] = DTensor.from_local(
                value.to_local(),
                mesh,
                (Replicate(), Shard(0), Shard(0)),
                run_check=False,
                shape=torch.Size(shape),
                stride=_contiguous_strides(shape),
            )
        return out

    def to_fsdp(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as ``to_global`` received it, holding what a load wrote into the views."""
        out = dict(state)
        for key, (mesh, placements, shape, stride) in self._fsdp_form.items():
            if key in out:
                local = out[key].to_local()
                out[key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        return out


def optimizer_fqn(key: str) -> str:
    """The parameter a flattened optimizer state key (``state.<fqn>.exp_avg``) belongs to."""
    return key[len("state.") :].rsplit(".", 1)[0] if key.startswith("state.") else ""
