"""Writing a checkpoint so that a crash never leaves a half-written one behind a good name.

Every rank writes into ``step-N.partial`` (DCP, with checksums: ``integrity.py``); once DCP has
written its metadata, rank 0 renames the folder to ``step-N``. Nothing non-finite is written, a
disk that refuses says so in one line (``save_failures.py``), and rotation never deletes the
save just written. ``manager.py`` decides when to save.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.checkpoint.agreement import agree
from trainer.checkpoint.disk import disk_refusal
from trainer.checkpoint.folders import PARTIAL_SUFFIX, partial_path, publish, step_folders
from trainer.checkpoint.integrity import ChecksummingWriter, checksumming_writer, first_non_finite, published_buffers
from trainer.checkpoint.location import Location, display, remove_tree
from trainer.checkpoint.save_failures import refusal_message
from trainer.checkpoint.states import Checkpointed, ModelState
from trainer.config import Checkpoint
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.runtime.errors import ConfigError, JobError
from trainer.runtime.weights_fence import WeightsFence

logger = logging.getLogger("meshtrain")

PINNED_STAGING = StagingOptions(
    use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
)
"""``async_with_pinned_mem``: the state copied into pinned host memory in the background, while
the next step's forward and backward run (the optimizer step waits for it), then written."""


class CheckpointWriter:
    """Saves ``states`` (the run's, ``run``) into ``folder``, at most one save in flight."""

    def __init__(
        self,
        config: Checkpoint,
        folder: Location,
        run: Checkpointed,
        states: dict[str, Stateful],
        group: dist.ProcessGroup,
        layout_invariant: bool,
        fence: WeightsFence | None = None,
    ):
        self.config = config
        self.folder = folder
        self.run = run
        self.states = states
        self.group = group
        self.layout_invariant = layout_invariant
        self.schedule = run.lr_scheduler.settings()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.fence = fence or WeightsFence()
        self._stager: DefaultStager | None = None
        self._pending: tuple[Future, Location, Location, int] | None = None

    def save(self, step: int, *, model_only: bool = False) -> None:
        self.finish_pending(wait=True)  # at most one save in flight
        self._check_finite(step, include_optimizer=not model_only)
        final = self.folder / f"step-{step}"
        partial = partial_path(final)
        try:
            agree(lambda: _empty_folder(partial), self.group)  # rank 0's failure reaches every rank
        except OSError as error:
            self._save_failed(error, partial, step)
        if model_only:
            dtype = getattr(torch, self.config.export_dtype)
            state: dict[str, Any] = {"model": ModelState(self.run.model, dtype)}
        else:
            state = dict(self.states)
        writer = checksumming_writer(partial, layout_invariant=self.layout_invariant)
        try:
            if self.config.async_mode == "async":
                # A Future unless an async stager is configured, which this mode never does.
                future = cast(Future, dcp.async_save(state, storage_writer=writer, process_group=self.group))
                self._pending = (future, partial, final, step)
            elif self.config.async_mode == "async_with_pinned_mem":
                self._stager = self._stager or DefaultStager(PINNED_STAGING)
                response = cast(
                    AsyncSaveResponse,
                    dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=self._stager),
                )
                self.fence.hold(response.staging_completion)
                self._pending = (response.upload_completion, partial, final, step)
            else:
                dcp.save(state, storage_writer=writer, process_group=self.group)
                self._publish(partial, final, step)
        except (Exception, CheckpointException) as error:
            self._save_failed(error, partial, step)

    def _check_finite(self, step: int, include_optimizer: bool) -> None:
        """Refuse, on every rank alike, to write a state holding a NaN or an infinity."""
        names = {id(p): name for name, p in self.run.model.named_parameters()}
        named = [(f"weight {name}", _local(p)) for name, p in self.run.model.named_parameters()]
        named += [(f"buffer {name}", _local(b)) for name, b in published_buffers(self.run.model)]
        if include_optimizer:
            for param, slots in self.run.optimizer.state.items():
                for slot, value in slots.items():
                    if isinstance(value, torch.Tensor):
                        named.append((f"optimizer state `{slot}` of {names.get(id(param), '?')}", _local(value)))
        found: list[str | None] = [None] * self.world_size
        dist.all_gather_object(found, first_non_finite(named), group=self.group)
        bad = next(((rank, what) for rank, what in enumerate(found) if what is not None), None)
        if bad is not None:
            kept = ", ".join(p.name for _, p in step_folders(self.folder)) or "none"
            lower = (
                "`moe.bias_update_rate`"
                if bad[1].endswith(".expert_bias")
                else "`optimizer.lr` (or `training.max_norm`)"
            )
            raise JobError(
                f"not saving checkpoint step-{step}: the {bad[1]} is not finite on rank {bad[0]}: the "
                f"run has diverged. Nothing was written; the older checkpoints are kept ({kept}). Lower "
                f"{lower}, check the data, and rerun: it resumes from "
                "the newest checkpoint (`checkpoint.load_step` picks an older one)."
            )

    def _save_failed(self, error: BaseException, partial: Location, step: int) -> NoReturn:
        """Remove the half-written folder, name a full or read-only disk as such, and raise."""
        if self.rank == 0:
            remove_tree(partial)
        refusal = disk_refusal(error)
        if refusal is None:
            raise error
        raise JobError(refusal_message(refusal, self.folder, partial, step)) from error

    def finish_pending(self, wait: bool) -> None:
        if self._pending is None:
            return
        future, partial, final, step = self._pending
        if not wait and not future.done():
            return
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as error:
            self._save_failed(error, partial, step)
        self._publish(partial, final, step)

    def _publish(self, partial: Location, final: Location, step: int) -> None:
        """Make a written checkpoint visible, then drop the oldest beyond ``keep_latest_k``.

        Only rank 0 renames: DCP writes the metadata on rank 0 after every rank reported its
        data written, so once rank 0's save returns the folder is complete. Rotation counts only
        checkpoints older than this one: the save just written is always kept, and a newer
        folder is not this timeline's (the load moved every newer one aside) and not ours to delete.
        """
        if self.rank != 0:
            return
        try:
            publish(partial, final, self.run.model_args, self.run.data_identity, self.schedule)
        except OSError as error:
            self._save_failed(error, partial, step)
        logger.info("saved checkpoint %s", display(final))
        if self.config.keep_latest_k > 0:
            older = [p for s, p in step_folders(self.folder) if s < step]
            for old in older[: max(0, len(older) - (self.config.keep_latest_k - 1))]:
                remove_tree(old)

    def close(self) -> None:
        """Wait for an async save still in flight."""
        self.finish_pending(wait=True)
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def check_pinned_staging(config: Checkpoint, device: str) -> None:
    """Pinned host memory is CUDA's: a job on another device cannot stage its checkpoints there."""
    if config.async_mode == "async_with_pinned_mem" and device != "cuda":
        raise ConfigError(
            f'`checkpoint.async_mode` = "async_with_pinned_mem" needs pinned host memory, which a {device} job has '
            'none of (pinning is CUDA\'s): use "async".'
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _empty_folder(folder: Location) -> None:
    remove_tree(folder)
    folder.mkdir(parents=True, exist_ok=True)


def create_seed_checkpoint(config: Checkpoint, dump_folder: str, model: Transformer, model_args: ModelArgs) -> Path:
    """Write ``step-0`` with the initial weights only (one process: ``plan`` refuses more)."""
    final = Path(dump_folder) / config.folder / "step-0"
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    remove_tree(partial)
    dcp.save({"model": ModelState(model)}, storage_writer=ChecksummingWriter(str(partial)))
    publish(partial, final, model_args)
    return final
