"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): exact resume on any mesh, crash-safe.

A checkpoint is the folder ``{job.dump_folder}/{checkpoint.folder}/step-N`` (torchtitan's
layout) holding the model, optimizer, LR scheduler, data-loader position and train state
(step, skipped-step count, RNG). DCP stores global tensors, so a checkpoint saved on one mesh
loads on any other: FSDP, HSDP, TP, CP, another world size. Because the global batch of a step
depends only on the step (see ``trainer/data/loader.py``), training then continues with the same
data, and in float32 on CPU with the same losses as a run that never stopped.

Crash safety: every rank writes into ``step-N.partial``; DCP writes its metadata last, after
all ranks have written; then rank 0 renames the folder to ``step-N`` (one atomic rename). A
kill during a save leaves a ``.partial`` folder, which is never loaded and is removed by the
next save of that step. Loading also checks every ``step-N`` before trusting it: metadata
readable, every file it references present and long enough. A failing checkpoint is skipped
with a warning naming it and the next older one is tried. The folder itself (its layout, the
whole-or-not check, ``model_args.json``) is ``trainer/checkpoint/folders.py``'s.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.checkpoint.folders import PARTIAL_SUFFIX, checkpoint_problem, is_model_only, publish, step_folders
from trainer.checkpoint.hf_folders import load_hf_folder
from trainer.config import Checkpoint
from trainer.model.hf_llama3 import from_hf_state_dict, model_args_from_hf_config
from trainer.model.llama3 import ModelArgs, Transformer, local_slice
from trainer.train_state import TrainState

logger = logging.getLogger("meshtrain")


class ModelState(Stateful):
    """The model's parameters by name, as (sharded) DTensors: DCP reshards them on load."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.dtype is not None:
            state = {k: v.to(self.dtype) for k, v in state.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name, so it reshards like the parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class CheckpointManager:
    """Saves on schedule, resumes at start; one object for the training loop to call."""

    def __init__(
        self,
        config: Checkpoint,
        dump_folder: str,
        *,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Stateful,
        train_state: TrainState,
        model_args: ModelArgs,
        total_steps: int,
    ):
        self.config = config
        self.folder = Path(dump_folder) / config.folder
        self.model, self.model_args = model, model_args
        self.total_steps = total_steps
        self.states: dict[str, Stateful] = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
        }
        self.rank = dist.get_rank()
        # Async saves run collectives from a background thread: give them their own group so
        # they never interleave with the training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if config.async_mode == "async" else None
        self._pending: tuple[Future, Path, Path] | None = None

    # ----------------------------------------------------------------------------------- load

    def load(self) -> int:
        """Restore the newest complete checkpoint (or ``load_step``); return the step to resume after.

        With no checkpoint in the folder (or with checkpoints disabled), ``initial_load_path``
        (if set) provides the starting weights. Returns 0 when training starts from scratch or
        from weights only.
        """
        choice = self._agree(self._choose_checkpoint) if self.config.enable else None
        if choice is not None:
            path = Path(choice)
            if is_model_only(path):
                logger.info("loading weights from %s (model-only checkpoint)", path)
                self._load(path, keys=("model",))
                return 0
            keys = tuple(k for k in self.states if k not in self.config.exclude_from_loading)
            logger.info("resuming from %s (%s)", path, ", ".join(keys))
            self._load(path, keys=keys)
            return self.states["train_state"].step
        if self.config.initial_load_path:
            return self._initial_load(Path(self.config.initial_load_path))
        return 0

    def _choose_checkpoint(self) -> str | None:
        candidates = step_folders(self.folder)
        if self.config.load_step >= 0:
            wanted = [p for step, p in candidates if step == self.config.load_step]
            if not wanted:
                raise FileNotFoundError(
                    f"`checkpoint.load_step` = {self.config.load_step}: no folder step-{self.config.load_step} "
                    f"in {self.folder}; found {[p.name for _, p in candidates] or 'none'}."
                )
            problem = checkpoint_problem(wanted[0])
            if problem:
                raise ValueError(f"`checkpoint.load_step`: {wanted[0]} cannot be loaded: {problem}.")
            return str(wanted[0])
        for _, path in reversed(candidates):
            problem = checkpoint_problem(path)
            if problem is None:
                return str(path)
            logger.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def _agree(self, choose: Callable[[], str | None]) -> str | None:
        """Every rank loads what rank 0 chose, even if their views of the file system differ.

        Rank 0's error is raised on every rank, so no rank is left waiting in a collective.
        """
        box: list[Any] = [None, None]
        if self.rank == 0:
            try:
                box[0] = choose()
            except (FileNotFoundError, ValueError) as e:
                box[1] = e
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise box[1]
        return box[0]

    def _load(self, path: Path, keys: tuple[str, ...]) -> None:
        dcp.load({k: self.states[k] for k in keys}, checkpoint_id=str(path))

    def _initial_load(self, path: Path) -> int:
        if self.config.initial_load_in_hf:
            self._load_hf(path)
            return 0
        problem = checkpoint_problem(path)
        if problem:
            raise ValueError(f"`checkpoint.initial_load_path` = {path} cannot be loaded: {problem}.")
        if self.config.initial_load_model_only or is_model_only(path):
            logger.info("loading weights from %s", path)
            self._load(path, keys=("model",))
            return 0
        logger.info("starting from the full state of %s", path)
        self._load(path, keys=tuple(self.states))
        return self.states["train_state"].step

    def _load_hf(self, path: Path) -> None:
        """Weights from a Hugging Face Llama folder, after checking it describes this model.

        Shapes alone would let a different RoPE base or norm epsilon load silently.
        """
        logger.info("loading Hugging Face weights from %s", path)
        hf_state, hf_cfg = load_hf_folder(str(path))
        theirs, ours = model_args_from_hf_config(hf_cfg), self.model_args
        fields = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim", "norm_eps",
                  "rope_theta", "rope_scaling", "rope_scaling_factor")
        differ = [f"{f}: {getattr(theirs, f)} there, {getattr(ours, f)} here" for f in fields
                  if getattr(theirs, f) != getattr(ours, f)]
        if differ:
            raise ValueError(
                f"`checkpoint.initial_load_path` = {path} holds a different model than `model.flavor` "
                f"describes ({'; '.join(differ)}); pick the matching flavor and tokenizer."
            )
        tied = bool(hf_cfg.get("tie_word_embeddings"))
        load_full_weights(self.model, from_hf_state_dict(hf_state, ours, tie_word_embeddings=tied))

    # ----------------------------------------------------------------------------------- save

    def maybe_save(self, step: int) -> None:
        """Save at every ``interval`` steps and at the last step; finish a completed async save."""
        if not self.config.enable:
            return
        self._finish_pending(wait=False)
        last = step == self.total_steps
        if step % self.config.interval and not last:
            return
        self.save(step, model_only=last and self.config.last_save_model_only)

    def save(self, step: int, *, model_only: bool = False) -> None:
        self._finish_pending(wait=True)  # at most one save in flight
        final = self.folder / f"step-{step}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)
        dist.barrier()
        if model_only:
            dtype = getattr(torch, self.config.export_dtype)
            state: dict[str, Any] = {"model": ModelState(self.model, dtype)}
        else:
            state = dict(self.states)
        if self.config.async_mode == "async":
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self._pending = (future, partial, final)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._publish(partial, final)

    def _finish_pending(self, wait: bool) -> None:
        if self._pending is None:
            return
        future, partial, final = self._pending
        if not wait and not future.done():
            return
        future.result()
        self._pending = None
        self._publish(partial, final)

    def _publish(self, partial: Path, final: Path) -> None:
        """Make a written checkpoint visible, then drop the oldest beyond ``keep_latest_k``.

        Only rank 0 renames: DCP writes the metadata on rank 0 after every rank reported its
        data written, so once rank 0's save returns the folder is complete.
        """
        if self.rank != 0:
            return
        publish(partial, final, self.model_args)
        logger.info("saved checkpoint %s", final)
        if self.config.keep_latest_k > 0:
            for _, old in step_folders(self.folder)[: -self.config.keep_latest_k]:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Wait for an async save still in flight."""
        self._finish_pending(wait=True)


def load_full_weights(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into a possibly sharded model, each rank its own slice."""
    params = dict(model.named_parameters())
    missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys()
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, param in params.items():
            full = state[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(param.shape)}")
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(local_slice(full.to(local.device, local.dtype), param))


def create_seed_checkpoint(config: Checkpoint, dump_folder: str, model: Transformer, model_args: ModelArgs) -> Path:
    """Write ``step-0`` with the initial weights only (one process: ``plan`` refuses more)."""
    final = Path(dump_folder) / config.folder / "step-0"
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    dcp.save({"model": ModelState(model)}, checkpoint_id=str(partial))
    publish(partial, final, model_args)
    return final
